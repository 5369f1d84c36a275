//! The cost of the kernel receive stamps on the request path: a stamped read (`recvmsg` with a
//! control buffer, the stamp turned into the monotonic clock) against a plain `read` of the
//! same bytes on the same kind of loopback socket, interleaved in blocks so noise falls on both.
//! The gateway does one stamped read per request on each side (client and upstream).
//!
//!   cargo bench --bench rx_time [-- --reads 200000]
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "benchmark binary: fail loudly"
)]

mod common;

use std::sync::Arc;
use std::time::Instant;

use fleetgate::rx_time::{self, RxClock, Side, StampedStream};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// A connected pair; the reading end wrapped, with the kernel stamps on or off.
async fn pair(stamps: bool) -> (TcpStream, StampedStream, Arc<RxClock>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    if stamps {
        rx_time::enable(&listener).unwrap();
    }
    let client = TcpStream::connect(listener.local_addr().unwrap())
        .await
        .unwrap();
    let (sock, _) = listener.accept().await.unwrap();
    let clock = Arc::new(RxClock::new(Side::Client));
    (client, StampedStream::new(sock, clock.clone()), clock)
}

/// `n` request-sized writes and reads; with `stamped`, every read is a stamped one (the
/// clock is re-armed by a one-byte answer, as a response re-arms it in the gateway; the plain
/// run writes the same answer). Returns ns per round.
async fn rounds(stamped: bool, n: usize, body: &[u8]) -> f64 {
    let (mut client, mut server, clock) = pair(stamped).await;
    let mut buf = vec![0u8; 4096];
    let mut one = [0u8; 1];
    let start = Instant::now();
    for _ in 0..n {
        client.write_all(body).await.unwrap();
        let mut got = 0;
        while got < body.len() {
            got += server.read(&mut buf).await.unwrap();
        }
        if stamped {
            assert!(clock.take_arrival().is_some(), "a stamp per request");
        }
        // The answer: re-arms the client-side clock in both runs alike.
        server.write_all(b"k").await.unwrap();
        client.read_exact(&mut one).await.unwrap();
    }
    start.elapsed().as_nanos() as f64 / n as f64
}

fn main() {
    let reads = common::arg("--reads", 100_000);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    // A typical streamed chat request: head and a short JSON body.
    let body = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\nauthorization: Bearer fg-stress-xxxxxxxxxxxx\r\ncontent-type: application/json\r\ncontent-length: 120\r\n\r\n{}",
        "x".repeat(120)
    );
    rt.block_on(async {
        let blocks = 10;
        let per = reads / blocks;
        let (mut plain, mut stamped) = (Vec::new(), Vec::new());
        rounds(false, 1000, body.as_bytes()).await;
        rounds(true, 1000, body.as_bytes()).await;
        for _ in 0..blocks {
            plain.push(rounds(false, per, body.as_bytes()).await);
            stamped.push(rounds(true, per, body.as_bytes()).await);
        }
        plain.sort_by(f64::total_cmp);
        stamped.sort_by(f64::total_cmp);
        let med = |v: &[f64]| v[v.len() / 2];
        let diff: Vec<f64> = {
            let mut d: Vec<f64> = plain.iter().zip(&stamped).map(|(p, s)| s - p).collect();
            d.sort_by(f64::total_cmp);
            d
        };
        println!(
            "round trip with a plain read:   median {:>8.0} ns (blocks of {per})",
            med(&plain)
        );
        println!(
            "round trip with a stamped read: median {:>8.0} ns",
            med(&stamped)
        );
        println!(
            "cost of a stamped read: {:+.0} ns per read (median of sorted block medians' difference {:+.0} ns)",
            med(&stamped) - med(&plain),
            med(&diff)
        );
    });
}
