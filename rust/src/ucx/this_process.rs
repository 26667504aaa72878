//! Whether a UCX worker address a peer hands us reaches this very process. UCX reads whatever
//! address of a process it reaches, registered or not (its self and cma transports copy
//! memory directly; over any transport that carries active messages, tcp and shared memory
//! included, the target worker answers a read with a copy of any address), so an endpoint to
//! a worker of this process would make us copy our own memory into our blocks.
//!
//! Every transport entry of the address is checked for what it reaches, as UCX 1.22 resolves
//! it, not compared byte for byte with our address (a peer can change any byte UCX does not
//! read, or name the same target differently): self by its interface id; cma and posix
//! shared memory by the pid they name (with its pid namespace) when they reach this host;
//! sysv shared memory by the process that created the segment they name, as the kernel says;
//! tcp by the address and port it connects to; any other transport by its device and
//! interface addresses. The targets of this process are those of its live workers, each
//! registered here while it exists ([`Registered`]).

use std::sync::Mutex;

use super::packed::{parse_worker_address, transport_checksum, unified_mode, Interface};

/// The packed addresses of this process's live workers.
static WORKERS: Mutex<Vec<Vec<u8>>> = Mutex::new(Vec::new());

fn workers() -> std::sync::MutexGuard<'static, Vec<Vec<u8>>> {
    WORKERS.lock().unwrap_or_else(|p| p.into_inner())
}

/// A worker of this process, counted as one while this lives.
pub(super) struct Registered {
    address: Vec<u8>,
}

impl Registered {
    pub(super) fn new(address: &[u8]) -> Registered {
        workers().push(address.to_vec());
        Registered { address: address.to_vec() }
    }
}

impl Drop for Registered {
    fn drop(&mut self) {
        let mut workers = workers();
        if let Some(at) = workers.iter().position(|a| *a == self.address) {
            workers.swap_remove(at);
        }
    }
}

/// The pid namespace UCX assumes for an address without one: the initial namespace's inode.
const DEFAULT_PID_NAMESPACE: u32 = 0xefff_fffc;
/// `UCT_CMA_IFACE_ADDR_FLAG_PID_NS`: the cma address carries its pid namespace.
const CMA_FLAG_PID_NS: u32 = 1 << 31;
/// `UCT_IFACE_LOCAL_ADDR_FLAG_NS`: a shared-memory device address carries its namespace.
const LOCAL_FLAG_NS: u64 = 1 << 63;
/// posix segment id flags (`UCT_POSIX_SEG_FLAG_*`) and the procfs pid field's width.
const POSIX_PROCFS: u64 = 1 << 63;
const POSIX_PID_NS: u64 = 1 << 60;
const POSIX_FLAGS: u64 = 0b1111 << 60;
const POSIX_PID_BITS: u32 = 30;
/// `uct_tcp_device_addr_t` flags: a loopback address carries no IP (it is 127.0.0.1 or ::1).
const TCP_LOOPBACK: u8 = 1;

/// Refuses `peer_address` if UCX would reach this very process through it, unless `vouched`
/// (the peer is proven to be this process: [`super::PeerProcess::is_this_process`]). A transport
/// entry too short for what UCX reads from it is refused too (UCX would read past it).
pub fn check_not_this_process(peer_address: &[u8], vouched: bool) -> Result<(), String> {
    if vouched {
        return Ok(());
    }
    let ours = workers();
    let refused = |why: String| {
        Err(format!("it hands us a UCX worker address that reaches this very process: {why}"))
    };
    let unified = unified_mode();
    let peer = parse_worker_address(peer_address, unified)?;
    let Some(peer) = peer.interfaces else {
        // Unified mode: the interfaces' lengths are our own, not in the bytes. Only a copy of
        // one of our addresses (whatever its uuid) is caught here; UCX's self transport
        // at the endpoint.
        let copy = ours.iter().any(|a| without_uuid(a) == without_uuid(peer_address));
        return match copy {
            true => refused("a copy of one of our addresses".to_owned()),
            false => Ok(()),
        };
    };
    let ours: Vec<Interface<'_>> = ours
        .iter()
        .filter_map(|a| parse_worker_address(a, unified).ok()?.interfaces)
        .flatten()
        .collect();
    for interface in &peer {
        if let Some(why) = reaches_us(interface, &ours)? {
            return refused(why);
        }
    }
    Ok(())
}

/// `address` without its worker uuid (after the header byte, and the flags byte in v2).
fn without_uuid(address: &[u8]) -> Vec<u8> {
    let uuid_at = if address.first().is_some_and(|h| h & 0x0f == 1) { 2 } else { 1 };
    let mut rest = address.to_vec();
    if rest.len() >= uuid_at + 8 {
        rest.drain(uuid_at..uuid_at + 8);
    }
    rest
}

/// Why `theirs` reaches this process (one of `ours`), if it does; an error if it is too short
/// for what UCX reads from it.
fn reaches_us(theirs: &Interface<'_>, ours: &[Interface<'_>]) -> Result<Option<String>, String> {
    let transport = theirs.transport;
    let same_transport: Vec<&Interface<'_>> =
        ours.iter().filter(|o| o.transport == transport).collect();
    if same_transport.is_empty() {
        // UCX uses only the transports it has itself.
        return Ok(None);
    }
    let short = |what: &str| format!("its {what} is shorter than UCX reads");
    let on_this_host = || -> Result<bool, String> {
        let device = local_address(theirs.device).ok_or_else(|| short("device address"))?;
        Ok(same_transport.iter().any(|o| local_address(o.device) == Some(device)))
    };
    let pid = std::process::id();
    if transport == transport_checksum("self") {
        let id = theirs.address.get(..8).ok_or_else(|| short("self address"))?;
        let ours = same_transport.iter().any(|o| o.address.get(..8) == Some(id));
        return Ok(ours.then(|| "its self transport names our worker".to_owned()));
    }
    if transport == transport_checksum("cma") {
        let id = u32_at(theirs.address, 0).ok_or_else(|| short("cma address"))?;
        let namespace = if id & CMA_FLAG_PID_NS != 0 {
            u32_at(theirs.address, 4).ok_or_else(|| short("cma address"))?
        } else {
            DEFAULT_PID_NAMESPACE
        };
        let ours = id & !CMA_FLAG_PID_NS == pid && Some(namespace) == our_pid_namespace();
        return Ok((ours && on_this_host()?).then(|| format!("its cma transport names pid {pid}")));
    }
    if transport == transport_checksum("posix") {
        let segment = u64_at(theirs.address, 0).ok_or_else(|| short("posix address"))?;
        let named = if segment & POSIX_PROCFS != 0 {
            let namespace = if segment & POSIX_PID_NS != 0 {
                u32_at(theirs.address, 8).ok_or_else(|| short("posix address"))?
            } else {
                DEFAULT_PID_NAMESPACE
            };
            (segment & ((1 << POSIX_PID_BITS) - 1)) as u32 == pid
                && Some(namespace) == our_pid_namespace()
        } else {
            let mmid = |s: u64| s & !POSIX_FLAGS;
            same_transport.iter().any(|o| u64_at(o.address, 0).map(mmid) == Some(mmid(segment)))
        };
        return Ok((named && on_this_host()?)
            .then(|| "its posix shared memory names a segment of ours".to_owned()));
    }
    if transport == transport_checksum("sysv") {
        // UCX attaches the segment id's low 32 bits as an int.
        let id = u64_at(theirs.address, 0).ok_or_else(|| short("sysv address"))? as u32 as i32;
        let ours = on_this_host()? && sysv_segment_creator(id) == Some(pid);
        return Ok(ours.then(|| format!("its sysv shared memory names segment {id}, ours")));
    }
    if transport == transport_checksum("tcp") {
        let targets = tcp_targets(theirs).ok_or_else(|| short("tcp address"))?;
        if theirs.device.first().is_some_and(|flags| flags & TCP_LOOPBACK != 0) {
            // A loopback address reaches only the network namespace it names.
            let namespace =
                local_address(&theirs.device[2..]).ok_or_else(|| short("tcp device address"))?;
            let here = same_transport.iter().any(|o| {
                o.device.first().is_some_and(|f| f & TCP_LOOPBACK != 0)
                    && o.device.get(2..).and_then(local_address) == Some(namespace)
            });
            if !here {
                return Ok(None);
            }
        }
        let ours =
            same_transport.iter().filter_map(|o| tcp_targets(o)).flatten().collect::<Vec<_>>();
        return Ok(targets.iter().find(|t| ours.contains(t)).map(|(ip, port)| {
            format!("its tcp transport connects to {ip}:{port}, our worker's listener")
        }));
    }
    let names_ours = same_transport
        .iter()
        .any(|o| o.device == theirs.device && !o.address.is_empty() && o.address == theirs.address);
    Ok(names_ours.then(|| "one of its transports names one of our interfaces".to_owned()))
}

/// The address and ports a tcp interface entry connects to (its interface's port and each
/// endpoint's): UCX connects to the device's IP, or the loopback address of its family.
fn tcp_targets(interface: &Interface<'_>) -> Option<Vec<(std::net::IpAddr, u16)>> {
    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
    let device = interface.device;
    let (flags, family) = (*device.first()?, *device.get(1)?);
    let ip = match (flags & TCP_LOOPBACK != 0, i32::from(family)) {
        (true, libc::AF_INET) => IpAddr::V4(Ipv4Addr::LOCALHOST),
        (true, libc::AF_INET6) => IpAddr::V6(Ipv6Addr::LOCALHOST),
        (false, libc::AF_INET) => IpAddr::V4(<[u8; 4]>::try_from(device.get(2..6)?).ok()?.into()),
        (false, libc::AF_INET6) => {
            IpAddr::V6(<[u8; 16]>::try_from(device.get(2..18)?).ok()?.into())
        }
        _ => return Some(Vec::new()),
    };
    let port = |a: &[u8]| Some(u16::from_be_bytes(a.get(..2)?.try_into().ok()?));
    let mut targets = vec![(ip, port(interface.address)?)];
    for endpoint in &interface.endpoints {
        targets.push((ip, port(endpoint)?));
    }
    Some(targets)
}

/// A shared-memory or loopback device address as UCX compares it (`uct_iface_local_addr_ns_t`):
/// the host's id with its namespace flag, and the namespace when flagged.
fn local_address(device: &[u8]) -> Option<(u64, Option<u32>)> {
    let id = u64_at(device, 0)?;
    let namespace = if id & LOCAL_FLAG_NS != 0 { Some(u32_at(device, 8)?) } else { None };
    Some((id, namespace))
}

/// The pid of the process that created sysv shared-memory segment `id` (of our IPC namespace),
/// if it exists and we may see it (else UCX cannot attach it either).
fn sysv_segment_creator(id: i32) -> Option<u32> {
    // SAFETY: all-zero is a valid shmid_ds, which shmctl only writes.
    let mut segment: libc::shmid_ds = unsafe { std::mem::zeroed() };
    // SAFETY: IPC_STAT writes one shmid_ds into `segment`, a local of that type.
    let status = unsafe { libc::shmctl(id, libc::IPC_STAT, &mut segment) };
    (status == 0).then_some(segment.shm_cpid as u32)
}

fn our_pid_namespace() -> Option<u32> {
    super::peer_process::pid_namespace().and_then(|ns| u32::try_from(ns).ok())
}

fn u32_at(bytes: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(bytes.get(at..at + 4)?.try_into().ok()?))
}

fn u64_at(bytes: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(bytes.get(at..at + 8)?.try_into().ok()?))
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::ucx::Worker;

    /// Where each transport entry of `address` starts (its interface address) and its name.
    fn entries(address: &[u8]) -> Vec<(&'static str, usize, usize)> {
        let offset = |part: &[u8]| part.as_ptr() as usize - address.as_ptr() as usize;
        let parsed = parse_worker_address(address, false).unwrap().interfaces.unwrap();
        parsed
            .iter()
            .map(|i| {
                let name = ["self", "cma", "tcp", "sysv", "posix"]
                    .into_iter()
                    .find(|n| transport_checksum(n) == i.transport)
                    .unwrap_or("?");
                (name, offset(i.address), i.address.len())
            })
            .collect()
    }

    /// `ours` with every transport naming another target: another self interface, pid 1 for
    /// cma and posix, a sysv segment nobody created, another tcp port.
    fn retargeted(ours: &[u8]) -> Vec<u8> {
        let mut elsewhere = ours.to_vec();
        for (name, at, len) in entries(ours) {
            match name {
                "self" => elsewhere[at] ^= 1,
                "cma" => elsewhere[at..at + 4].copy_from_slice(&1u32.to_le_bytes()),
                "posix" => {
                    let segment = u64_at(ours, at).unwrap();
                    let moved = (segment & !((1 << POSIX_PID_BITS) - 1)) | 1;
                    elsewhere[at..at + 8].copy_from_slice(&moved.to_le_bytes());
                }
                "sysv" => elsewhere[at..at + 8].copy_from_slice(&0x7fff_fff0u64.to_le_bytes()),
                "tcp" => elsewhere[at] ^= 0x40,
                _ => assert!(len == 0 || name != "?", "an unknown transport in {ours:02x?}"),
            }
        }
        elsewhere
    }

    #[test]
    fn our_address_reaches_us_whatever_its_uuid_and_another_process_does_not() {
        let worker = Worker::new("this-process", None).unwrap();
        let ours = worker.address().to_vec();
        let err = check_not_this_process(&ours, false).unwrap_err();
        assert!(err.contains("its self transport names our worker"), "{err}");
        assert_eq!(check_not_this_process(&ours, true), Ok(()), "vouched: the peer is us");
        let mut other_uuid = ours.clone();
        other_uuid[2] ^= 1;
        assert!(check_not_this_process(&other_uuid, false).is_err());
        // The same transports naming other targets.
        let elsewhere = retargeted(&ours);
        assert_eq!(check_not_this_process(&elsewhere, false), Ok(()));
        // Any one transport naming us again is enough.
        for (name, at, len) in entries(&ours) {
            let mut one = elsewhere.clone();
            one[at..at + len].copy_from_slice(&ours[at..at + len]);
            let err = check_not_this_process(&one, false).unwrap_err();
            assert!(err.contains(&format!("its {name} ")), "{name}: {err}");
        }
    }

    #[test]
    fn an_entry_shorter_than_ucx_reads_is_refused() {
        let worker = Worker::new("short-entry", None).unwrap();
        let ours = worker.address().to_vec();
        let (_, at, len) = entries(&ours).into_iter().find(|e| e.0 == "cma").unwrap();
        // Cut the cma address to 2 bytes: its length is in the low bits of the byte before it.
        let mut short = retargeted(&ours)[..at].to_vec();
        short[at - 1] = (short[at - 1] & !0x3f) | 2;
        short.extend(&ours[at..at + 2]);
        short.extend(&ours[at + len..]);
        let err = check_not_this_process(&short, false).unwrap_err();
        assert!(err.contains("cma address is shorter than UCX reads"), "{err}");
    }

    #[test]
    fn an_endpoint_that_resolves_to_this_worker_is_refused() {
        let worker = Worker::new("self-lane", None).unwrap();
        let mut other_uuid = worker.address().to_vec();
        other_uuid[2] ^= 1;
        let err = worker.connect(&other_uuid, Arc::from([]), &[], false).err().unwrap();
        assert!(err.to_string().contains("resolves to this very worker"), "{err}");
    }
}
