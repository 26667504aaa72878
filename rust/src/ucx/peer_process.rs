//! Which process is on the other end of a side channel, as the kernel says, not as the peer
//! says: the process whose descriptor table holds the socket at the other end of our TCP
//! connection.
//!
//! An owner names, with each connection's metadata, its pid, its pid namespace and its
//! descriptor of that connection's socket. The reader asks its network namespace's socket table
//! (`sock_diag` netlink, an exact lookup by the connection's 4-tuple) for the socket whose
//! local end is our peer's address and whose remote end is ours, the other end of our socket,
//! and reads the named descriptor's link in `/proc/<pid>/fd`: it must be that socket. A peer
//! can only name a process that holds its end of this very connection, which it cannot hand
//! to another process without that process's cooperation. Reading `/proc/<pid>/fd` needs the
//! ptrace read access that reading the process's memory needs anyway.

use std::io;
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::Duration;

/// Why a peer's process is not taken as proven.
#[derive(Debug, PartialEq, Eq)]
pub enum OpenError {
    /// The claim is false: the named process holds something else than the other end of this
    /// connection at the named descriptor. A peer that makes one is lying about who it is (or a
    /// relay forwards another process's claim).
    Forged(String),
    /// The claim cannot be checked (the process is gone or not ours to inspect, the other end
    /// of the connection is not in this network namespace, the kernel lacks `sock_diag`): UCX
    /// may still read the peer.
    Unreadable(String),
}

impl std::fmt::Display for OpenError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Forged(why) | Self::Unreadable(why) => f.write_str(why),
        }
    }
}

/// A process on this host, proven to hold the other end of a side channel's connection, held
/// by a pidfd (so that its pid, once it exits, is never taken for another process's).
pub struct PeerProcess {
    pid: libc::pid_t,
    /// Readable once the process has exited.
    pidfd: OwnedFd,
}

impl PeerProcess {
    /// Proves that process `pid` (a pid of our namespace) holds, at descriptor `fd`, the socket
    /// at the other end of `socket`'s connection. `Forged` when the kernel shows the claim
    /// false, `Unreadable` when it cannot be checked.
    pub fn prove(socket: &TcpStream, pid: u32, fd: u32) -> Result<PeerProcess, OpenError> {
        let pid = libc::pid_t::try_from(pid)
            .ok()
            .filter(|&p| p > 0)
            .ok_or_else(|| OpenError::Forged(format!("pid {pid} is out of range")))?;
        let unreadable = |e: String| OpenError::Unreadable(e);
        let ours = socket.local_addr().map_err(|e| unreadable(format!("getsockname: {e}")))?;
        let theirs = socket.peer_addr().map_err(|e| unreadable(format!("getpeername: {e}")))?;
        if ours == theirs {
            return Err(unreadable("the connection is connected to itself".to_owned()));
        }
        let inode = socket_inode(theirs, ours).map_err(unreadable)?;
        let process = PeerProcess::open(pid).map_err(unreadable)?;
        let link = std::fs::read_link(format!("/proc/{pid}/fd/{fd}"))
            .map_err(|e| unreadable(format!("process {pid}'s descriptor {fd}: {e}")));
        // Checked after the link was read: a process alive then is the one the pidfd names.
        if process.exited() {
            return Err(unreadable(format!("process {pid} exited")));
        }
        let link = link?;
        let expected = format!("socket:[{inode}]");
        if link.as_os_str() != expected.as_str() {
            return Err(OpenError::Forged(format!(
                "process {pid} does not hold the other end of this connection (descriptor {fd} \
                 is {}, not {expected}): the peer names another process, or a relay forwards \
                 its claim",
                link.display()
            )));
        }
        Ok(process)
    }

    pub(super) fn open(pid: libc::pid_t) -> Result<PeerProcess, String> {
        // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        if fd < 0 {
            return Err(format!("pidfd_open({pid}): {}", io::Error::last_os_error()));
        }
        // SAFETY: fd is a descriptor pidfd_open just returned, owned by nobody else.
        let pidfd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
        Ok(PeerProcess { pid, pidfd })
    }

    pub fn pid(&self) -> u32 {
        self.pid as u32
    }

    pub(super) fn raw_pid(&self) -> libc::pid_t {
        self.pid
    }

    /// Whether it is this very process (an engine of this process on the other end).
    pub fn is_this_process(&self) -> bool {
        self.pid() == std::process::id()
    }

    /// Whether the process has exited (its pid may then name another process).
    pub(super) fn exited(&self) -> bool {
        loop {
            let mut fds =
                libc::pollfd { fd: self.pidfd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
            // SAFETY: one valid pollfd, zero timeout.
            let ready = unsafe { libc::poll(&mut fds, 1, 0) };
            if ready < 0 && io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
                continue;
            }
            // Readable: exited. An error on a pidfd we own: treat as exited, never read on.
            return ready != 0;
        }
    }
}

/// This process's pid namespace (the inode `/proc/self/ns/pid` links to): pids mean the same
/// process only to processes of one namespace. `None` where it cannot be read.
pub fn pid_namespace() -> Option<u64> {
    let link = std::fs::read_link("/proc/self/ns/pid").ok()?;
    let link = link.to_str()?;
    link.strip_prefix("pid:[")?.strip_suffix(']')?.parse().ok()
}

/// `SOCK_DIAG_BY_FAMILY` (linux/sock_diag.h).
const SOCK_DIAG_BY_FAMILY: u16 = 20;
const NLMSG_HEADER_LEN: usize = 16;
/// `struct inet_diag_req_v2`: family, protocol, extensions, pad, states, then the socket id.
const DIAG_REQUEST_LEN: usize = 56;
/// `struct inet_diag_sockid`: ports, two 16-byte addresses, interface, cookie.
const DIAG_ID_LEN: usize = 48;
/// `struct inet_diag_msg`: family, state, timer, retransmits, the socket id, expiry, queues,
/// uid, inode.
const DIAG_MSG_LEN: usize = 72;
const DIAG_MSG_INODE_AT: usize = 68;
const DIAG_TIMEOUT: Duration = Duration::from_secs(1);

/// The inode of the TCP socket in this network namespace whose local end is `local` and whose
/// remote end is `remote`, by an exact `sock_diag` lookup (the kernel looks an IPv6 request
/// whose addresses are both v4-mapped up as IPv4, whichever family the socket has).
fn socket_inode(local: SocketAddr, remote: SocketAddr) -> Result<u32, String> {
    diag_lookup(local, remote)?.ok_or_else(|| {
        "no socket at the other end of this connection in this network namespace".to_owned()
    })
}

/// The socket id of `inet_diag_sockid` for `local` and `remote`, without interface or cookie.
fn diag_id(local: SocketAddr, remote: SocketAddr) -> [u8; DIAG_ID_LEN - 12] {
    let mut id = [0u8; DIAG_ID_LEN - 12];
    id[0..2].copy_from_slice(&local.port().to_be_bytes());
    id[2..4].copy_from_slice(&remote.port().to_be_bytes());
    for (at, ip) in [(4, local.ip()), (20, remote.ip())] {
        match ip {
            IpAddr::V4(v4) => id[at..at + 4].copy_from_slice(&v4.octets()),
            IpAddr::V6(v6) => id[at..at + 16].copy_from_slice(&v6.octets()),
        }
    }
    id
}

/// The inode of the socket `local`..`remote`, `None` if there is none.
fn diag_lookup(local: SocketAddr, remote: SocketAddr) -> Result<Option<u32>, String> {
    if local.is_ipv4() != remote.is_ipv4() {
        return Err("the connection's ends are of different address families".to_owned());
    }
    let family = if local.is_ipv4() { libc::AF_INET } else { libc::AF_INET6 };
    let id = diag_id(local, remote);
    let mut request = Vec::with_capacity(NLMSG_HEADER_LEN + DIAG_REQUEST_LEN);
    request.extend(((NLMSG_HEADER_LEN + DIAG_REQUEST_LEN) as u32).to_ne_bytes());
    request.extend(SOCK_DIAG_BY_FAMILY.to_ne_bytes());
    request.extend((libc::NLM_F_REQUEST as u16).to_ne_bytes());
    request.extend(1u32.to_ne_bytes()); // sequence number
    request.extend(0u32.to_ne_bytes()); // port id: the kernel's
    request.extend([family as u8, libc::IPPROTO_TCP as u8, 0, 0]);
    request.extend(u32::MAX.to_ne_bytes()); // every state
    request.extend(id);
    request.extend(0u32.to_ne_bytes()); // any interface
    request.extend([0xff; 8]); // INET_DIAG_NOCOOKIE
    let reply = netlink_exchange(&request)?;
    parse_diag_reply(&reply, &id)
}

/// Sends `request` to the kernel's `sock_diag` and returns its one reply.
fn netlink_exchange(request: &[u8]) -> Result<Vec<u8>, String> {
    let io_error = |what: &str| format!("sock_diag {what}: {}", io::Error::last_os_error());
    // SAFETY: socket takes no pointers and returns a new descriptor or -1.
    let fd = unsafe {
        libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_DGRAM | libc::SOCK_CLOEXEC,
            libc::NETLINK_SOCK_DIAG,
        )
    };
    if fd < 0 {
        return Err(io_error("socket"));
    }
    // SAFETY: fd is a descriptor socket just returned, owned by nobody else.
    let socket = unsafe { OwnedFd::from_raw_fd(fd) };
    let timeout = libc::timeval { tv_sec: DIAG_TIMEOUT.as_secs() as libc::time_t, tv_usec: 0 };
    // SAFETY: the option value is a timeval of the size passed.
    let set = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            (&timeout as *const libc::timeval).cast(),
            std::mem::size_of::<libc::timeval>() as libc::socklen_t,
        )
    };
    if set != 0 {
        return Err(io_error("setsockopt"));
    }
    // SAFETY: all-zero is a valid sockaddr_nl; the family makes it the kernel's address.
    let mut kernel: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
    kernel.nl_family = libc::AF_NETLINK as libc::sa_family_t;
    // SAFETY: the buffer and the address are valid for the lengths passed.
    let sent = unsafe {
        libc::sendto(
            socket.as_raw_fd(),
            request.as_ptr().cast(),
            request.len(),
            0,
            (&kernel as *const libc::sockaddr_nl).cast(),
            std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t,
        )
    };
    if sent != request.len() as isize {
        return Err(io_error("send"));
    }
    let mut reply = vec![0u8; 8192];
    // SAFETY: the buffer is valid for writes of its length.
    let got = unsafe { libc::recv(socket.as_raw_fd(), reply.as_mut_ptr().cast(), reply.len(), 0) };
    if got < 0 {
        return Err(io_error("receive"));
    }
    reply.truncate(got as usize);
    Ok(reply)
}

/// The inode of the socket in `reply`, the kernel's answer to a lookup of `id`: an
/// `inet_diag_msg` for that socket (its ports checked; its addresses may be given in the other
/// family's form), or an error (`ENOENT`: no such socket here, `None`). Every field is read
/// within the reply's length.
fn parse_diag_reply(reply: &[u8], id: &[u8]) -> Result<Option<u32>, String> {
    let u32_at = |at: usize| -> Option<u32> {
        Some(u32::from_ne_bytes(reply.get(at..at + 4)?.try_into().ok()?))
    };
    let short = || format!("sock_diag: a reply of {} bytes is too short", reply.len());
    let len = u32_at(0).ok_or_else(short)? as usize;
    let kind =
        u16::from_ne_bytes(reply.get(4..6).ok_or_else(short)?.try_into().unwrap_or_default());
    if len > reply.len() || len < NLMSG_HEADER_LEN {
        return Err(short());
    }
    if kind == libc::NLMSG_ERROR as u16 {
        let errno = (u32_at(NLMSG_HEADER_LEN).ok_or_else(short)? as i32).wrapping_neg();
        if errno == libc::ENOENT {
            return Ok(None);
        }
        return Err(format!("sock_diag: {}", io::Error::from_raw_os_error(errno)));
    }
    if kind != SOCK_DIAG_BY_FAMILY || len < NLMSG_HEADER_LEN + DIAG_MSG_LEN {
        return Err(format!("sock_diag: an unexpected reply (type {kind}, {len} bytes)"));
    }
    let message = &reply[NLMSG_HEADER_LEN..len];
    if message[4..8] != id[..4] {
        return Err("sock_diag: the reply is about another socket".to_owned());
    }
    u32_at(NLMSG_HEADER_LEN + DIAG_MSG_INODE_AT).ok_or_else(short).map(Some)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    /// A connection on loopback, both ends in this process: (client, accepted).
    fn connection() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (accepted, _) = listener.accept().unwrap();
        (client, accepted)
    }

    #[test]
    fn the_process_holding_the_other_end_is_proven_and_no_other() {
        let (client, accepted) = connection();
        let pid = std::process::id();
        let proven = PeerProcess::prove(&client, pid, accepted.as_raw_fd() as u32).unwrap();
        assert!(proven.is_this_process() && !proven.exited());
        // Our own end, another socket of this process, a descriptor that is not a socket.
        let (other, _other_accepted) = connection();
        for fd in [client.as_raw_fd(), other.as_raw_fd(), 0] {
            let err = PeerProcess::prove(&client, pid, fd as u32).err().unwrap();
            assert!(matches!(err, OpenError::Forged(_)), "descriptor {fd}: {err}");
        }
        // A descriptor that does not exist, another process, no process.
        let err = PeerProcess::prove(&client, pid, 1 << 30).err().unwrap();
        assert!(matches!(err, OpenError::Unreadable(_)), "{err}");
        let mut child = std::process::Command::new("sleep").arg("30").spawn().unwrap();
        let err =
            PeerProcess::prove(&client, child.id(), accepted.as_raw_fd() as u32).err().unwrap();
        assert!(matches!(err, OpenError::Forged(_) | OpenError::Unreadable(_)), "{err}");
        child.kill().unwrap();
        child.wait().unwrap();
        let err = PeerProcess::prove(&client, u32::MAX, 3).err().unwrap();
        assert!(matches!(err, OpenError::Forged(_)), "{err}");
        let err = PeerProcess::prove(&client, 0, 3).err().unwrap();
        assert!(matches!(err, OpenError::Forged(_)), "{err}");
    }

    #[test]
    fn an_ipv6_connection_is_proven_too() {
        // Where this host has IPv6 loopback: its own, and a v4-mapped one to an IPv4 listener.
        let Ok(listener) = TcpListener::bind("[::1]:0") else { return };
        let client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (accepted, _) = listener.accept().unwrap();
        let pid = std::process::id();
        let proven = PeerProcess::prove(&client, pid, accepted.as_raw_fd() as u32);
        assert!(proven.is_ok(), "{}", proven.err().unwrap());
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let mapped = format!("[::ffff:127.0.0.1]:{}", listener.local_addr().unwrap().port());
        let Ok(client) = TcpStream::connect(mapped) else { return };
        assert!(client.local_addr().unwrap().is_ipv6());
        let (accepted, _) = listener.accept().unwrap();
        let proven = PeerProcess::prove(&client, pid, accepted.as_raw_fd() as u32);
        assert!(proven.is_ok(), "v4-mapped: {}", proven.err().unwrap());
    }

    #[test]
    fn an_ended_connection_proves_nothing() {
        let (client, accepted) = connection();
        let fd = accepted.as_raw_fd() as u32;
        drop(accepted);
        // The descriptor is gone, or (other tests run meanwhile) another file's.
        assert!(PeerProcess::prove(&client, std::process::id(), fd).is_err());
    }

    #[test]
    fn this_process_has_a_pid_namespace() {
        assert!(pid_namespace().is_some_and(|ns| ns > 0));
    }

    #[test]
    fn a_diag_reply_is_read_within_its_length() {
        let id = [7u8; DIAG_ID_LEN - 12];
        let mut reply = ((NLMSG_HEADER_LEN + DIAG_MSG_LEN) as u32).to_ne_bytes().to_vec();
        reply.extend(SOCK_DIAG_BY_FAMILY.to_ne_bytes());
        reply.extend([0u8; 10]);
        reply.extend([0u8; 4]);
        reply.extend(id);
        reply.resize(NLMSG_HEADER_LEN + DIAG_MSG_INODE_AT, 0);
        reply.extend(1234u32.to_ne_bytes());
        assert_eq!(parse_diag_reply(&reply, &id), Ok(Some(1234)));
        for cut in 0..reply.len() {
            assert!(parse_diag_reply(&reply[..cut], &id).is_err(), "cut at {cut}");
        }
        let mut other_ports = id;
        other_ports[1] ^= 1;
        assert!(parse_diag_reply(&reply, &other_ports).is_err());
        let error = |errno: i32| {
            let mut reply = ((NLMSG_HEADER_LEN + 20) as u32).to_ne_bytes().to_vec();
            reply.extend((libc::NLMSG_ERROR as u16).to_ne_bytes());
            reply.extend([0u8; 10]);
            reply.extend((-errno).to_ne_bytes());
            reply.resize(NLMSG_HEADER_LEN + 20, 0);
            reply
        };
        assert_eq!(parse_diag_reply(&error(libc::ENOENT), &id), Ok(None), "no such socket");
        assert!(parse_diag_reply(&error(libc::EPERM), &id).is_err());
    }
}
