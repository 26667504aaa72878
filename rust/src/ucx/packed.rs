//! Checks of the packed bytes a peer hands us for UCX: its worker address and its regions'
//! remote keys. `ucp_ep_create` and `ucp_ep_rkey_unpack` take them without a length and parse
//! them trusting every length and flag inside, so a short or garbage blob reads past its end,
//! and some values (an unknown address version) end the process in a UCX assertion.
//!
//! Each check walks the bytes the way UCX 1.22 unpacks them (`src/ucp/wireup/address.c`,
//! `ucp_address_unpack`; `src/ucp/core/ucp_rkey.c`, `ucp_ep_rkey_unpack_internal`) and accepts
//! only bytes that UCX reads entirely within the blob, with the versions, counts and memory
//! types UCX accepts, and nothing left over. What stays trusted is the content of each
//! transport's own device, interface, endpoint and key bytes (the transports parse those at
//! their own fixed sizes, which only they know); a shared secret makes the peer an engine
//! that holds it, which is what covers those.

use crate::handshake::MemoryType;

/// Address format versions (`ucp_object_version_t`); any other value aborts in UCX.
const ADDRESS_V1: u8 = 0;
const ADDRESS_V2: u8 = 1;
const HEADER_VERSION_MASK: u8 = 0x0f;
const HEADER_SHIFT: u8 = 4;
const HEADER_FLAG_DEBUG_INFO: u8 = 1 << 0;
const HEADER_FLAG_WORKER_UUID: u8 = 1 << 1;
const HEADER_FLAG_CLIENT_ID: u8 = 1 << 2;
/// `UCP_NULL_RESOURCE`: an address without devices.
const NULL_RESOURCE: u8 = 0xff;
const FLAG_LAST: u8 = 0x80;
const FLAG_HAS_EP_ADDR: u8 = 0x40;
const FLAG_NUM_PATHS: u8 = 0x40;
const FLAG_SYS_DEVICE: u8 = 0x20;
const FLAG_MD_EMPTY_DEV: u8 = 0x80;
const MD_MASK: u8 = !FLAG_MD_EMPTY_DEV;
const DEVICE_LEN_MASK: u8 = !(FLAG_SYS_DEVICE | FLAG_NUM_PATHS | FLAG_LAST);
const IFACE_LEN_MASK: u8 = !(FLAG_HAS_EP_ADDR | FLAG_LAST);
/// `ucp_address_packed_iface_attr_t` (v1) and `ucp_address_v2_packed_iface_attr_t` (v2).
const IFACE_ATTR_V1_LEN: usize = 16;
const IFACE_ATTR_V2_LEN: usize = 8;
/// `UCP_MAX_RESOURCES` and `UCP_MAX_LANES`: UCX refuses addresses with more.
const MAX_RESOURCES: usize = 128;
const MAX_LANES: usize = 64;

/// `UCS_SYS_DEVICE_ID_UNKNOWN`, which also ends a key's list of distances.
const SYS_DEVICE_UNKNOWN: u8 = 0xff;
/// `ucp_rkey_packed_distance_t`: a device, a latency and a bandwidth byte.
const RKEY_DISTANCE_LEN: usize = 3;
/// `UCS_MEMORY_TYPE_*` a key of each of our memory types may carry.
const MEMORY_TYPE_HOST: u8 = 0;
const MEMORY_TYPE_CUDA: u8 = 1;
const MEMORY_TYPE_CUDA_MANAGED: u8 = 2;

/// Reads a blob front to back; every read past its end is an error naming what was read.
struct Cursor<'a> {
    bytes: &'a [u8],
    at: usize,
    what: &'static str,
}

impl<'a> Cursor<'a> {
    fn new(bytes: &'a [u8], what: &'static str) -> Self {
        Cursor { bytes, at: 0, what }
    }

    fn take(&mut self, n: usize, field: &str) -> Result<&'a [u8], String> {
        let end =
            self.at.checked_add(n).filter(|&end| end <= self.bytes.len()).ok_or_else(|| {
                format!(
                    "the {} ends inside its {field} ({} bytes, {n} needed at offset {})",
                    self.what,
                    self.bytes.len(),
                    self.at
                )
            })?;
        let taken = &self.bytes[self.at..end];
        self.at = end;
        Ok(taken)
    }

    fn byte(&mut self, field: &str) -> Result<u8, String> {
        Ok(self.take(1, field)?[0])
    }

    fn peek(&self, field: &str) -> Result<u8, String> {
        self.bytes
            .get(self.at)
            .copied()
            .ok_or_else(|| format!("the {} ends before its {field}", self.what))
    }

    /// A value in the low bits `mask` of a byte; in address v2, all of them set means the
    /// value is in the next byte (`ucp_address_unpack_byte_extended`).
    fn extended(&mut self, mask: u8, v2: bool, field: &str) -> Result<u8, String> {
        let value = self.byte(field)? & mask;
        if v2 && value == mask {
            return self.byte(field);
        }
        Ok(value)
    }

    fn finish(&self) -> Result<(), String> {
        match self.bytes.len() - self.at {
            0 => Ok(()),
            left => Err(format!(
                "the {} has {left} bytes after its end (of {})",
                self.what,
                self.bytes.len()
            )),
        }
    }
}

/// One transport interface of a packed worker address, as `ucp_ep_create` unpacks it: UCX
/// matches it to a transport of its own by `transport` and reaches it at `device` and
/// `address` (or, for transports connected endpoint to endpoint, at one of `endpoints`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Interface<'a> {
    /// `ucs_crc16_string` of the transport's name ([`transport_checksum`]).
    pub transport: u16,
    pub device: &'a [u8],
    pub address: &'a [u8],
    pub endpoints: Vec<&'a [u8]>,
}

/// A packed worker address, walked as `ucp_ep_create` unpacks it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerAddress<'a> {
    /// Its interfaces; `None` in unified mode (see [`parse_worker_address`]).
    pub interfaces: Option<Vec<Interface<'a>>>,
}

/// How UCX names a transport in a packed address: `ucs_crc16_string` (CRC-16-CCITT, reflected,
/// initial value and final complement all ones) of its name.
pub fn transport_checksum(name: &str) -> u16 {
    let mut crc = u16::MAX;
    for &byte in name.as_bytes() {
        crc ^= u16::from(byte);
        for _ in 0..8 {
            crc = (crc >> 1) ^ if crc & 1 != 0 { 0x8408 } else { 0 };
        }
    }
    !crc
}

/// Parses a peer's packed worker address as `ucp_ep_create` unpacks it, refusing any that UCX
/// would read past its end. `unified` is this worker's `UCX_UNIFIED_MODE`: there the lengths
/// of a peer's transport addresses are taken from our own interfaces, not from the bytes, so
/// only the header can be checked and no interface is returned.
pub fn parse_worker_address(bytes: &[u8], unified: bool) -> Result<WorkerAddress<'_>, String> {
    let mut c = Cursor::new(bytes, "worker address");
    let header = c.byte("header")?;
    let v2 = match header & HEADER_VERSION_MASK {
        ADDRESS_V1 => false,
        ADDRESS_V2 => true,
        other => {
            return Err(format!(
                "the worker address has version {other}, which UCX 1.22 does not know (0 or 1)"
            ))
        }
    };
    let flags = if v2 { c.byte("header flags")? } else { header >> HEADER_SHIFT };
    if unified {
        return Ok(WorkerAddress { interfaces: None });
    }
    // ucp_ep_create unpacks with the worker uuid and name flags; v1 always carries the uuid.
    if !v2 || flags & HEADER_FLAG_WORKER_UUID != 0 {
        c.take(8, "worker uuid")?;
    }
    if flags & HEADER_FLAG_CLIENT_ID != 0 {
        c.take(8, "client id")?;
    }
    if flags & HEADER_FLAG_DEBUG_INFO != 0 {
        let len = c.byte("worker name length")?;
        c.take(len.into(), "worker name")?;
    }
    let mut interfaces = Vec::new();
    if c.peek("device list")? == NULL_RESOURCE {
        c.byte("device list")?;
        c.finish()?;
        return Ok(WorkerAddress { interfaces: Some(interfaces) });
    }
    let attr_len = if v2 { IFACE_ATTR_V2_LEN } else { IFACE_ATTR_V1_LEN };
    loop {
        let empty = c.peek("device")? & FLAG_MD_EMPTY_DEV != 0;
        c.extended(MD_MASK, v2, "memory domain index")?;
        let device_flags = c.peek("device address length")? & !DEVICE_LEN_MASK;
        let device_len = c.extended(DEVICE_LEN_MASK, v2, "device address length")?;
        if device_flags & FLAG_NUM_PATHS != 0 {
            c.byte("device path count")?;
        }
        if device_flags & FLAG_SYS_DEVICE != 0 {
            c.byte("system device")?;
        }
        let device = c.take(device_len.into(), "device address")?;
        let mut last_interface = empty;
        while !last_interface {
            if interfaces.len() == MAX_RESOURCES {
                return Err(format!(
                    "the worker address lists over {MAX_RESOURCES} transport interfaces"
                ));
            }
            let checksum = c.take(2, "transport name checksum")?;
            let transport = u16::from_le_bytes([checksum[0], checksum[1]]);
            c.take(attr_len, "interface attributes")?;
            let interface_flags = c.peek("interface address length")?;
            last_interface = interface_flags & FLAG_LAST != 0;
            let interface_len = c.extended(IFACE_LEN_MASK, v2, "interface address length")?;
            let address = c.take(interface_len.into(), "interface address")?;
            let mut endpoints = Vec::new();
            let mut last_endpoint = interface_flags & FLAG_HAS_EP_ADDR == 0;
            while !last_endpoint {
                if endpoints.len() == MAX_LANES {
                    return Err(format!("the worker address lists over {MAX_LANES} endpoint addresses for one interface"));
                }
                let endpoint_len = c.byte("endpoint address length")?;
                endpoints.push(c.take(endpoint_len.into(), "endpoint address")?);
                last_endpoint = c.byte("lane index")? & FLAG_LAST != 0;
            }
            interfaces.push(Interface { transport, device, address, endpoints });
        }
        if device_flags & FLAG_LAST != 0 {
            c.finish()?;
            return Ok(WorkerAddress { interfaces: Some(interfaces) });
        }
    }
}

/// Whether this process's UCX workers run in unified mode (`UCX_UNIFIED_MODE`, a UCX boolean).
pub fn unified_mode() -> bool {
    std::env::var("UCX_UNIFIED_MODE")
        .is_ok_and(|v| matches!(v.to_ascii_lowercase().as_str(), "y" | "yes" | "on" | "1"))
}

/// Checks a peer's packed remote key for a region of `memory` as `ucp_ep_rkey_unpack`
/// unpacks it (from a UCX >= 1.20 peer: a key with memory domains carries its system device,
/// and a known device a list of distances ended by the unknown device).
pub fn check_rkey(bytes: &[u8], memory: MemoryType) -> Result<(), String> {
    let mut c = Cursor::new(bytes, "remote key");
    let md_map = u64::from_le_bytes(c.take(8, "memory domain map")?.try_into().unwrap_or_default());
    let memory_type = c.byte("memory type")?;
    let expected: &[u8] = match memory {
        MemoryType::Host => &[MEMORY_TYPE_HOST],
        MemoryType::Cuda => &[MEMORY_TYPE_CUDA, MEMORY_TYPE_CUDA_MANAGED],
    };
    if !expected.contains(&memory_type) {
        return Err(format!("the remote key has UCX memory type {memory_type}, not one of {expected:?} for {memory:?} memory"));
    }
    for _ in 0..md_map.count_ones() {
        let len = c.byte("transport key length")?;
        c.take(len.into(), "transport key")?;
    }
    if md_map != 0 {
        // A known device (with or without its flush bit) is followed by distances, which
        // UCX reads up to the unknown device.
        if c.byte("system device")? != SYS_DEVICE_UNKNOWN {
            while c.peek("device distances' end")? != SYS_DEVICE_UNKNOWN {
                c.take(RKEY_DISTANCE_LEN, "device distance")?;
            }
            c.byte("device distances' end")?;
        }
    }
    c.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A v2 address: uuid, one device with a 2-byte address, one interface with a 3-byte
    /// address and one endpoint address, then the v1-style release-version device.
    fn address() -> Vec<u8> {
        let mut a = vec![ADDRESS_V2 | (3 << HEADER_SHIFT), HEADER_FLAG_WORKER_UUID];
        a.extend([9u8; 8]);
        a.extend([2, 2, 0xaa, 0xbb]); // md 2, a 2-byte device address (not the last device)
        a.extend([0x12, 0x34]); // tl name checksum
        a.extend([1u8; IFACE_ATTR_V2_LEN]);
        a.extend([FLAG_LAST | FLAG_HAS_EP_ADDR | 3, 7, 7, 7]);
        a.extend([1, 5, FLAG_LAST]); // a 1-byte endpoint address, its lane, the last
        a.extend([FLAG_MD_EMPTY_DEV | 4, FLAG_LAST]); // empty last device
        a
    }

    #[test]
    fn a_well_formed_address_passes_and_every_cut_or_extension_of_it_fails() {
        let a = address();
        assert_eq!(parse_worker_address(&a, false).map(|_| ()), Ok(()));
        for cut in 0..a.len() {
            assert!(parse_worker_address(&a[..cut], false).is_err(), "cut at {cut}");
        }
        let mut longer = a.clone();
        longer.push(0);
        assert!(parse_worker_address(&longer, false).unwrap_err().contains("after its end"));
        assert!(parse_worker_address(&[0xff; 512], false).unwrap_err().contains("version 15"));
        assert!(parse_worker_address(&[0xff; 512], true).unwrap_err().contains("version 15"));
    }

    #[test]
    fn a_remote_key_is_read_to_its_exact_end() {
        let mut key = 0b101u64.to_le_bytes().to_vec();
        key.push(MEMORY_TYPE_HOST);
        key.extend([2, 1, 1, 0]); // two transport keys: 2 bytes, then none
        key.extend([3, 0x10, 0x20, 0x30, SYS_DEVICE_UNKNOWN]); // device 3, one distance, the end
        assert_eq!(check_rkey(&key, MemoryType::Host), Ok(()));
        for cut in 0..key.len() {
            assert!(check_rkey(&key[..cut], MemoryType::Host).is_err(), "cut at {cut}");
        }
        assert!(check_rkey(&key, MemoryType::Cuda).unwrap_err().contains("memory type 0"));
        let mut flushed = key.clone();
        flushed[13] |= 0x80; // the device's flush bit: still a known device, still distances
        assert_eq!(check_rkey(&flushed, MemoryType::Host), Ok(()));
        let mut unknown_device = key[..13].to_vec();
        unknown_device.push(SYS_DEVICE_UNKNOWN);
        assert_eq!(check_rkey(&unknown_device, MemoryType::Host), Ok(()));
        unknown_device.push(0);
        assert!(check_rkey(&unknown_device, MemoryType::Host).is_err());
    }
}
