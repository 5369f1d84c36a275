//! Which protocol a connection speaks, known before hyper reads a byte of it.
//!
//! hyper-util's auto server finds out by reading the first 24 bytes (HTTP/2's connection
//! preface is 24 bytes long) into a buffer of its own and handing them back to the protocol
//! through a rewinding wrapper. HTTP/1.1's reader then holds those 24 bytes of a request,
//! wants a full buffer's room beyond them and doubles its buffer to 16 KiB, for the life of
//! the connection: 8 KiB more for every open stream. Here a cleartext connection is *peeked*
//! (the bytes stay in the kernel), and TLS says it with ALPN; hyper's connection then reads
//! the request from its first byte.

use std::io;
use std::time::Duration;

use crate::rx_time::StampedStream;

/// HTTP/2's client connection preface (RFC 9113, section 3.4).
const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// What a connection speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Proto {
    Http1,
    /// HTTP/2 by prior knowledge (h2c) or by ALPN.
    Http2,
    /// Not known yet: the protocol is told by the bytes (hyper-util's own detection).
    Unknown,
}

/// A protocol told by TLS's ALPN, when the client named one.
pub(super) fn from_alpn(alpn: Option<&[u8]>) -> Proto {
    match alpn {
        Some(b"h2") => Proto::Http2,
        Some(b"http/1.1") => Proto::Http1,
        _ => Proto::Unknown,
    }
}

/// The protocol of a cleartext connection, from its first bytes, left unread. `None`: the
/// peer closed before sending a byte. The first bytes of a request settle it (an HTTP/1.1
/// request line differs from the preface by its second byte at the latest); a peer that sends
/// a prefix of the preface and pauses is peeked again, 1 ms later, until the rest has come
/// (the connection's header timeout bounds the wait).
pub(super) async fn sniff(stream: &StampedStream) -> io::Result<Option<Proto>> {
    let mut seen = [0u8; PREFACE.len()];
    loop {
        let n = stream.peek(&mut seen).await?;
        if n == 0 {
            return Ok(None);
        }
        if seen[..n] != PREFACE[..n] {
            return Ok(Some(Proto::Http1));
        }
        if n == PREFACE.len() {
            return Ok(Some(Proto::Http2));
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};

    use super::*;
    use crate::rx_time::{RxClock, Side};

    async fn pair() -> (TcpStream, StampedStream) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (server, _) = listener.accept().await.unwrap();
        let clock = Arc::new(RxClock::new(Side::Client));
        (client, StampedStream::new(server, clock))
    }

    #[tokio::test]
    async fn a_request_line_is_http1_and_stays_unread() {
        let (mut client, mut server) = pair().await;
        client
            .write_all(b"POST /v1/chat/completions HTTP/1.1\r\n")
            .await
            .unwrap();
        assert_eq!(sniff(&server).await.unwrap(), Some(Proto::Http1));
        let mut line = [0u8; 4];
        server.read_exact(&mut line).await.unwrap();
        assert_eq!(&line, b"POST", "the bytes are still there for hyper");
    }

    #[tokio::test]
    async fn the_preface_is_http2_even_in_pieces() {
        let (mut client, server) = pair().await;
        client.write_all(&PREFACE[..5]).await.unwrap();
        let sniffing = tokio::spawn(async move { sniff(&server).await.unwrap() });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(
            !sniffing.is_finished(),
            "a prefix of the preface tells nothing yet"
        );
        client.write_all(&PREFACE[5..]).await.unwrap();
        assert_eq!(sniffing.await.unwrap(), Some(Proto::Http2));
    }

    #[tokio::test]
    async fn a_peer_that_closes_at_once_is_none() {
        let (client, server) = pair().await;
        drop(client);
        assert_eq!(sniff(&server).await.unwrap(), None);
    }

    #[test]
    fn alpn_names_the_protocol() {
        assert_eq!(from_alpn(Some(b"h2")), Proto::Http2);
        assert_eq!(from_alpn(Some(b"http/1.1")), Proto::Http1);
        assert_eq!(from_alpn(None), Proto::Unknown);
    }
}
