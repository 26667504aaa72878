//! An active man in the middle between a reader and an owner that share a secret: it relays
//! every byte but rewrites a hello or the metadata frame. The authentication must cover them.

mod common;

use std::net::{TcpListener, TcpStream};
use std::thread;

use common::{connect_to, fingerprint, start, TIMEOUT};
use kvduplex::handshake::wire::Frame;
use kvduplex::handshake::HandshakeError;

const SECRET: &[u8] = b"shared secret";

/// A relay in front of `server_port`: returns its port. Rewrites the client's first two frames
/// (hello, proof) with `client_side` and the server's first three (hello, proof, metadata) with
/// `server_side`.
fn relay(
    server_port: u16,
    client_side: fn(Frame) -> Frame,
    server_side: fn(Frame) -> Frame,
) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    thread::spawn(move || {
        let (client, _) = listener.accept().unwrap();
        let server = TcpStream::connect(("127.0.0.1", server_port)).unwrap();
        let (c2, s2) = (client.try_clone().unwrap(), server.try_clone().unwrap());
        thread::spawn(move || common::pump(c2, s2, 2, client_side));
        common::pump(server, client, 3, server_side);
    });
    port
}

fn connect_through(
    client_side: fn(Frame) -> Frame,
    server_side: fn(Frame) -> Frame,
) -> Result<kvduplex::handshake::EngineMetadata, HandshakeError> {
    let server = start(Some(SECRET));
    let port = relay(server.local_addr().port(), client_side, server_side);
    connect_to(port, "reader", &fingerprint("bf16"), Some(SECRET), TIMEOUT).map(|(_, meta)| meta)
}

#[test]
fn an_untouched_relay_passes() {
    let meta = connect_through(|f| f, |f| f).unwrap();
    assert_eq!(meta.engine_id, "owner");
}

#[test]
fn a_rewritten_metadata_frame_is_refused() {
    let got = connect_through(
        |f| f,
        |f| match f {
            Frame::Metadata(mut m) => {
                m.generation += 1;
                m.worker_address = vec![6; 64];
                Frame::Metadata(m)
            }
            other => other,
        },
    );
    assert!(got.is_err(), "the reader took metadata the man in the middle wrote: {got:?}");
}

#[test]
fn a_rewritten_server_hello_is_refused() {
    let got = connect_through(
        |f| f,
        |f| match f {
            Frame::ServerHello(mut h) => {
                h.heartbeat_ms = 60_000;
                Frame::ServerHello(h)
            }
            other => other,
        },
    );
    assert!(got.is_err(), "the reader took a server hello the man in the middle wrote: {got:?}");
}

#[test]
fn a_rewritten_client_hello_is_refused() {
    let got = connect_through(
        |f| match f {
            Frame::ClientHello(mut h) => {
                h.engine_id = "someone-else".into();
                h.side_channel = Some("10.9.9.9:1".into());
                Frame::ClientHello(h)
            }
            other => other,
        },
        |f| f,
    );
    assert!(got.is_err(), "the owner took a client hello the man in the middle wrote: {got:?}");
}
