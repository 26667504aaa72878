//! How a side channel names the sender of a lookup or notification, and so the reader a hold's
//! claim is bound to: the engine id the client announced and the connection it came on,
//! `engine-id#connection`. A leaf both the side channel (which names senders) and the hold
//! book (which binds claims to them) use.

/// A claim made through one connection is thus released only through it: another client
/// cannot end it by announcing the same engine id.
pub fn sender_name(engine_id: &str, connection: u64) -> String {
    format!("{engine_id}#{connection}")
}

/// The engine id of a [`sender_name`].
pub fn sender_engine(sender: &str) -> &str {
    sender.rsplit_once('#').map_or(sender, |(engine_id, _)| engine_id)
}
