//! A metadata frame's body as a peer sends it, then every check the reader runs on it before
//! using it: the metadata's own validation, the packed UCX bytes, the layout against the
//! regions and the compatibility check. Never a panic, never a hang (libFuzzer's -timeout).
#![no_main]

use kvduplex::descriptors::{RegionBounds, RegionIndex};
use kvduplex::handshake::wire::{decode_frame, FrameKind, FRAME_HEADER_LEN, MAGIC};
use kvduplex::handshake::{wire::Frame, PROTOCOL_VERSION};
use kvduplex::ucx_packed::{check_rkey, parse_worker_address};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|body: &[u8]| {
    let mut frame = Vec::with_capacity(FRAME_HEADER_LEN + body.len());
    frame.extend_from_slice(&MAGIC);
    frame.extend_from_slice(&PROTOCOL_VERSION.to_be_bytes());
    frame.push(FrameKind::Metadata as u8);
    frame.extend_from_slice(&(body.len() as u32).to_be_bytes());
    frame.extend_from_slice(body);
    let Ok(Frame::Metadata(meta)) = decode_frame(&frame) else { return };
    let _ = meta.validate();
    let _ = parse_worker_address(&meta.worker_address, false);
    let _ = parse_worker_address(&meta.worker_address, true);
    for region in &meta.regions {
        let _ = check_rkey(&region.rkey, region.memory);
    }
    let _ = meta.fingerprint.check_compatible(&Default::default());
    let regions: Vec<RegionBounds> = meta.regions.iter().map(|r| RegionBounds { addr: r.addr, len: r.len }).collect();
    if let Some(layout) = &meta.layout {
        let _ = layout.validate_within(&regions);
    }
    let _ = RegionIndex::new(&regions);
});
