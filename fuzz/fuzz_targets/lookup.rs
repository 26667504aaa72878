//! Lookup and lookup-reply frames as peers send them, and an owner's hold book answering the
//! decoded lookups: never a panic.
#![no_main]

use std::time::{Duration, Instant};

use kvduplex::handshake::wire::{decode_frame, encode_frame, Frame, FrameKind, FRAME_HEADER_LEN, MAGIC};
use kvduplex::handshake::PROTOCOL_VERSION;
use kvduplex::holds::{HoldBook, HoldKind};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&which, body)) = data.split_first() else { return };
    let kind = if which & 1 == 0 { FrameKind::Lookup } else { FrameKind::LookupReply };
    let mut frame = Vec::with_capacity(FRAME_HEADER_LEN + body.len());
    frame.extend_from_slice(&MAGIC);
    frame.extend_from_slice(&PROTOCOL_VERSION.to_be_bytes());
    frame.push(kind as u8);
    frame.extend_from_slice(&(body.len() as u32).to_be_bytes());
    frame.extend_from_slice(body);
    let Ok(decoded) = decode_frame(&frame) else { return };
    if let Ok(again) = encode_frame(&decoded) {
        assert_eq!(decode_frame(&again).ok().as_ref(), Some(&decoded));
    }
    if let Frame::Lookup(request) = decoded {
        let now = Instant::now();
        let mut book = HoldBook::new();
        let held: Vec<u64> = request.fingerprints.iter().take(8).copied().collect();
        let _ = book.hold("turn", HoldKind::Turn, held.len(), held.clone(), 0, b"offer".to_vec(), now + Duration::from_secs(60), now);
        let _ = book.hold("prompt", HoldKind::ForDecode, held.len(), held, 0, Vec::new(), now + Duration::from_secs(60), now);
        if let Some(end) = request.continues {
            let _ = book.expect("computing", end);
        }
        let _ = book.awaited(&request.fingerprints, request.continues);
        let _ = book.lookup("reader#1", &request.fingerprints, Duration::from_secs(5), now);
        if let Some(name) = &request.request_id {
            let _ = book.grant("reader#1", name, &request.fingerprints, Duration::from_secs(5), now);
        }
        let _ = book.expire(now + Duration::from_secs(61));
    }
});
