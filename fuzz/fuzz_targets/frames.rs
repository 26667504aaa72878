//! The frame decoder, whole and as a stream cut at arbitrary points: never a panic, and the
//! stream gives the frames (or the error) that decoding them whole gives.
#![no_main]

use kvduplex::handshake::wire::{decode_frame, encode_frame, FrameBuffer, MAX_CONTROL_FRAME_LEN};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&cuts, bytes)) = data.split_first() else { return };
    let whole = decode_frame(bytes);
    // A decoded frame encodes to a frame that decodes to the same.
    if let Ok(frame) = &whole {
        if let Ok(again) = encode_frame(frame) {
            assert_eq!(decode_frame(&again).ok().as_ref(), Some(frame));
        }
    }
    let limited = cuts & 0x80 != 0;
    let mut stream = FrameBuffer::new();
    if limited {
        stream.set_limit(Some(MAX_CONTROL_FRAME_LEN));
    }
    // Feed the bytes in pieces of 1..=16 bytes, sized by the first byte.
    let piece = usize::from(cuts & 0x0f) + 1;
    let mut frames = Vec::new();
    for chunk in bytes.chunks(piece) {
        stream.extend(chunk);
        loop {
            match stream.next_frame() {
                Ok(Some(frame)) => frames.push(frame),
                Ok(None) => break,
                Err(e) => {
                    assert!(whole.is_err() || limited, "the stream failed ({e}) on bytes that decode whole");
                    return;
                }
            }
        }
    }
    if let (Ok(frame), false) = (&whole, limited) {
        assert_eq!(frames.as_slice(), std::slice::from_ref(frame), "the stream decodes what the whole bytes decode to");
    }
});
