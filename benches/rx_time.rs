//! The cost of the kernel receive stamps on the request path: a stamped read (`recvmsg` with a
//! control buffer, the stamp turned into the monotonic clock: `rx_time::recv_stamped`) against
//! a plain `read` of the same bytes, on one loopback connection with the stamps on, in
//! alternating blocks so noise falls on both. Blocking sockets: the figure is the syscall and
//! the stamp's handling, without the event loop (the same for both in the gateway). The gateway
//! does one stamped read per request on each side (client and upstream).
//!
//!   cargo bench --bench rx_time [-- --reads 200000]
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "benchmark binary: fail loudly"
)]

mod common;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::time::Instant;

use fleetgate_gateway::rx_time;

/// `n` request-sized writes, each read back on the accepted end by `recvmsg` with its stamp
/// (`stamped`) or by `read`. Returns ns per read (write included, the same in both) and how
/// many reads were stamped.
fn rounds(
    client: &mut TcpStream,
    server: &mut TcpStream,
    stamped: bool,
    n: usize,
    body: &[u8],
) -> (f64, usize) {
    let mut buf = vec![0u8; 16 * 1024];
    let fd = server.as_raw_fd();
    let mut stamps = 0;
    let start = Instant::now();
    for _ in 0..n {
        client.write_all(body).unwrap();
        let mut got = 0;
        while got < body.len() {
            if stamped {
                let (k, stamp) = rx_time::recv_stamped(fd, &mut buf).unwrap();
                got += k;
                stamps += usize::from(stamp.is_some());
            } else {
                got += server.read(&mut buf).unwrap();
            }
        }
    }
    (start.elapsed().as_nanos() as f64 / n as f64, stamps)
}

fn main() {
    let reads = common::arg("--reads", 200_000);
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    rx_time::enable(&listener).unwrap();
    let mut client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
    let (mut server, _) = listener.accept().unwrap();
    client.set_nodelay(true).unwrap();
    // The host turns packet stamping on a moment after the first socket asks.
    std::thread::sleep(std::time::Duration::from_millis(100));
    // A typical streamed chat request: head and a short JSON body.
    let body = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\nauthorization: Bearer fg-stress-xxxxxxxxxxxx\r\ncontent-type: application/json\r\ncontent-length: 120\r\n\r\n{}",
        "x".repeat(120)
    );
    let body = body.as_bytes();
    let blocks = 20;
    let per = reads / blocks;
    rounds(&mut client, &mut server, false, 2000, body);
    rounds(&mut client, &mut server, true, 2000, body);
    let (mut plain, mut stamped, mut diff) = (Vec::new(), Vec::new(), Vec::new());
    let mut stamps = 0;
    for b in 0..blocks {
        // Alternate which goes first.
        let order = if b % 2 == 0 {
            [false, true]
        } else {
            [true, false]
        };
        let mut this = [0.0; 2];
        for s in order {
            let (ns, k) = rounds(&mut client, &mut server, s, per, body);
            this[usize::from(s)] = ns;
            if s {
                stamps += k;
            }
        }
        plain.push(this[0]);
        stamped.push(this[1]);
        diff.push(this[1] - this[0]);
    }
    let med = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    println!(
        "stamped reads: {stamps} of {} (a stamp on every recvmsg)",
        per * blocks
    );
    println!(
        "write + plain read:    median {:>7.0} ns per request ({blocks} blocks of {per})",
        med(&mut plain)
    );
    println!(
        "write + stamped read:  median {:>7.0} ns per request",
        med(&mut stamped)
    );
    println!(
        "cost of a stamped read over a plain one: {:+.0} ns (median of the blocks' differences)",
        med(&mut diff)
    );
}
