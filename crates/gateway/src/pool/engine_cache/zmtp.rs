//! A ZeroMQ client for the two sockets a KV-event subscriber opens: SUB (the engine's PUB) and
//! DEALER (its replay ROUTER). ZMTP 3.0 over TCP with the NULL mechanism, which is what vLLM's
//! pyzmq (libzmq 4.3) speaks to a 3.0 peer: a 64-byte greeting each way, a READY command
//! naming the socket type, then frames; a subscription is a message whose first byte is 1.
//!
//! Written here rather than taken from a crate because a frame's declared length must be
//! refused before anything is allocated for it: the pure-Rust `zeromq` crate reserves the
//! length a peer announces, and libzmq's `ZMQ_MAXMSGSIZE` would put a C library in the image.
//! Everything past what a subscriber needs (other mechanisms, 3.1's commands, sending to
//! several peers) is left out.

use std::io;
use std::time::Duration;

use bytes::Bytes;
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

/// Which socket this side is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Sub,
    Dealer,
}

impl Kind {
    fn name(self) -> &'static [u8] {
        match self {
            Kind::Sub => b"SUB",
            Kind::Dealer => b"DEALER",
        }
    }

    /// The peer socket types this one may talk to.
    fn accepts(self, peer: &[u8]) -> bool {
        match self {
            Kind::Sub => peer == b"PUB" || peer == b"XPUB",
            Kind::Dealer => peer == b"ROUTER" || peer == b"DEALER",
        }
    }
}

/// Frames in one message at most (vLLM sends 3; a replay answer 2 after the delimiter).
const MAX_FRAMES: usize = 8;

/// One connection to a publisher or a replay endpoint.
pub(crate) struct Conn {
    stream: BufReader<TcpStream>,
    /// The largest frame accepted; a larger declared length ends the connection.
    max_frame: usize,
}

fn protocol(what: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.into())
}

impl Conn {
    /// Connects and completes the handshake within `timeout`.
    pub(crate) async fn connect(
        addr: &str,
        kind: Kind,
        max_frame: usize,
        timeout: Duration,
    ) -> io::Result<Conn> {
        tokio::time::timeout(timeout, Self::handshake(addr, kind, max_frame))
            .await
            .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "no ZeroMQ handshake"))?
    }

    async fn handshake(addr: &str, kind: Kind, max_frame: usize) -> io::Result<Conn> {
        let tcp = TcpStream::connect(addr).await?;
        tcp.set_nodelay(true)?;
        let mut conn = Conn {
            stream: BufReader::with_capacity(64 << 10, tcp),
            max_frame,
        };
        let mut greeting = [0u8; 64];
        greeting[0] = 0xff;
        greeting[9] = 0x7f;
        greeting[10] = 3; // version 3.0
        greeting[12..16].copy_from_slice(b"NULL");
        conn.stream.get_mut().write_all(&greeting).await?;
        let mut peer = [0u8; 64];
        conn.stream.read_exact(&mut peer).await?;
        if peer[0] != 0xff || peer[9] & 1 != 1 {
            return Err(protocol("the peer is not a ZeroMQ socket"));
        }
        if peer[10] < 3 {
            return Err(protocol(format!(
                "the peer speaks ZMTP {}.{}, not 3",
                peer[10], peer[11]
            )));
        }
        if &peer[12..17] != b"NULL\0" {
            return Err(protocol(
                "the peer asks for a security mechanism (only NULL is supported)",
            ));
        }
        let mut ready = Vec::with_capacity(32);
        ready.push(5);
        ready.extend_from_slice(b"READY");
        ready.push(11);
        ready.extend_from_slice(b"Socket-Type");
        let name = kind.name();
        ready.extend_from_slice(&(name.len() as u32).to_be_bytes());
        ready.extend_from_slice(name);
        conn.write_frame(0x04, &ready).await?;
        let (is_command, body) = conn.read_frame().await?;
        if !is_command {
            return Err(protocol("the peer sent a message before READY"));
        }
        let peer_type = command(&body, b"READY").and_then(|props| property(props, b"Socket-Type"));
        match peer_type {
            Some(t) if kind.accepts(t) => Ok(conn),
            Some(t) => Err(protocol(format!(
                "the peer is a {} socket",
                String::from_utf8_lossy(t)
            ))),
            None => Err(protocol(command_error(&body))),
        }
    }

    /// SUB: receive the messages whose first frame starts with `topic`.
    pub(crate) async fn subscribe(&mut self, topic: &[u8]) -> io::Result<()> {
        let mut body = Vec::with_capacity(1 + topic.len());
        body.push(1);
        body.extend_from_slice(topic);
        self.write_frame(0, &body).await?;
        self.stream.get_mut().flush().await
    }

    /// DEALER: send one message.
    pub(crate) async fn send(&mut self, frames: &[&[u8]]) -> io::Result<()> {
        for (i, f) in frames.iter().enumerate() {
            let more = u8::from(i + 1 < frames.len());
            self.write_frame(more, f).await?;
        }
        self.stream.get_mut().flush().await
    }

    /// The next message's frames. Commands between messages are skipped, except ERROR.
    pub(crate) async fn recv(&mut self) -> io::Result<Vec<Bytes>> {
        let mut frames = Vec::with_capacity(3);
        let mut total = 0usize;
        loop {
            let (more, is_command, body) = self.read_frame_flags().await?;
            if is_command {
                if command(&body, b"ERROR").is_some() {
                    return Err(protocol(command_error(&body)));
                }
                continue;
            }
            total += body.len();
            if total > self.max_frame + 1024 {
                return Err(protocol(format!(
                    "a message over {} bytes",
                    self.max_frame + 1024
                )));
            }
            frames.push(body);
            if !more {
                return Ok(frames);
            }
            if frames.len() == MAX_FRAMES {
                return Err(protocol(format!("a message of over {MAX_FRAMES} frames")));
            }
        }
    }

    async fn write_frame(&mut self, flags: u8, body: &[u8]) -> io::Result<()> {
        let w = self.stream.get_mut();
        if body.len() > 255 {
            w.write_all(&[flags | 0x02]).await?;
            w.write_all(&(body.len() as u64).to_be_bytes()).await?;
        } else {
            w.write_all(&[flags, body.len() as u8]).await?;
        }
        w.write_all(body).await
    }

    async fn read_frame(&mut self) -> io::Result<(bool, Bytes)> {
        let (_, is_command, body) = self.read_frame_flags().await?;
        Ok((is_command, body))
    }

    /// One frame: (more follows, is a command, body). A declared length over the limit ends
    /// the connection before any of it is read.
    async fn read_frame_flags(&mut self) -> io::Result<(bool, bool, Bytes)> {
        let flags = self.stream.read_u8().await?;
        if flags & !0x07 != 0 {
            return Err(protocol(format!("a frame with flags {flags:#04x}")));
        }
        let len = if flags & 0x02 != 0 {
            self.stream.read_u64().await?
        } else {
            u64::from(self.stream.read_u8().await?)
        };
        if len > self.max_frame as u64 {
            return Err(protocol(format!(
                "a frame of {len} bytes, over the {}-byte limit",
                self.max_frame
            )));
        }
        let mut body = vec![0u8; len as usize];
        self.stream.read_exact(&mut body).await?;
        Ok((flags & 0x01 != 0, flags & 0x04 != 0, Bytes::from(body)))
    }
}

/// A command's properties when it is the command `name`.
fn command<'a>(body: &'a [u8], name: &[u8]) -> Option<&'a [u8]> {
    let (&n, rest) = body.split_first()?;
    let (found, props) = rest.split_at_checked(usize::from(n))?;
    (found == name).then_some(props)
}

/// A property's value in a READY command's properties.
fn property<'a>(mut props: &'a [u8], name: &[u8]) -> Option<&'a [u8]> {
    while let Some((&n, rest)) = props.split_first() {
        let (key, rest) = rest.split_at_checked(usize::from(n))?;
        let (len, rest) = rest.split_at_checked(4)?;
        let len = u32::from_be_bytes(len.try_into().ok()?) as usize;
        let (value, rest) = rest.split_at_checked(len)?;
        if key.eq_ignore_ascii_case(name) {
            return Some(value);
        }
        props = rest;
    }
    None
}

/// What a command that is not the expected READY says.
fn command_error(body: &[u8]) -> String {
    match command(body, b"ERROR") {
        Some(reason) => format!(
            "the peer refused: {}",
            String::from_utf8_lossy(reason.get(1..).unwrap_or_default())
        ),
        None => "the peer's handshake is not a READY command".to_owned(),
    }
}
