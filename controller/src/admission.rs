//! Who may hold a connection to the mTLS listener, and for how long.
//!
//! Anything on the network can open TCP connections and finish TLS without
//! a client certificate (enrollment needs no certificate). Unchecked, 5,000
//! such idle connections cost the controller 5,000 descriptors and tasks,
//! and slow handshakes hold tasks too. So, per source address and in all:
//!
//! - handshakes in progress are capped ([`Limits::handshakes_per_ip`]);
//!   beyond the cap a new connection is closed at once;
//! - connections without a client certificate (enrollment, health) are
//!   capped ([`Limits::anonymous_per_ip`], [`Limits::anonymous_total`])
//!   and live at most [`Limits::anonymous_lifetime`] (an enrollment takes
//!   well under a second); beyond the cap one is closed after its handshake.
//!
//! Known connections (a certificate of the site's CA, or of a recorded
//! peer's CA: agents, admins, peers; see `auth::Authenticator::is_known`)
//! are not capped here: each call is authorized. A certificate no trusted
//! CA signed counts as none: a Join from a new peer, too, comes in under
//! the caps above.

use std::collections::HashMap;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::server::TlsStream;
use tonic::transport::server::Connected;

#[derive(Clone, Copy, Debug)]
pub struct Limits {
    pub handshakes_per_ip: usize,
    pub anonymous_per_ip: usize,
    pub anonymous_total: usize,
    pub anonymous_lifetime: Duration,
    /// How long calls in flight may still take once an anonymous
    /// connection's lifetime is over; then it is closed.
    pub anonymous_grace: Duration,
    /// Shed connections held at once; each gets its GOAWAY after
    /// `shed_lifetime` and is closed `shed_grace` later.
    pub shed_total: usize,
    pub shed_lifetime: Duration,
    pub shed_grace: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            // Room for a site's burst of enrollments behind one NAT address.
            handshakes_per_ip: 256,
            anonymous_per_ip: 128,
            anonymous_total: 1024,
            anonymous_lifetime: Duration::from_secs(10),
            // A slow link's enrollment (a CSR signed, a store write) fits;
            // an idle connection is gone 20 s after its handshake.
            anonymous_grace: Duration::from_secs(10),
            // Enough to answer an overload's burst; few enough that an idle
            // flood holds few descriptors.
            shed_total: 16,
            // Long enough for its client's first call to arrive and be
            // answered (a GOAWAY before it would make the client fail the
            // call itself, unsent: tonic does not retry such a call).
            shed_lifetime: Duration::from_secs(1),
            shed_grace: Duration::from_secs(1),
        }
    }
}

/// Counts of unauthenticated connections, per source address.
#[derive(Debug)]
pub struct Admission {
    limits: Limits,
    counts: Mutex<Counts>,
}

#[derive(Debug, Default)]
struct Counts {
    handshakes: HashMap<IpAddr, usize>,
    anonymous: HashMap<IpAddr, usize>,
    anonymous_total: usize,
    shed: usize,
}

/// What a held slot counts as.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Slot {
    Handshake,
    Anonymous,
    Shed,
}

/// A held slot; released on drop.
#[derive(Debug)]
pub struct Ticket {
    admission: Arc<Admission>,
    ip: IpAddr,
    slot: Slot,
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut c = self.admission.counts.lock().unwrap();
        let map = match self.slot {
            Slot::Handshake => &mut c.handshakes,
            Slot::Anonymous => &mut c.anonymous,
            Slot::Shed => {
                c.shed -= 1;
                return;
            }
        };
        if let Some(n) = map.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                map.remove(&self.ip);
            }
        }
        if self.slot == Slot::Anonymous {
            c.anonymous_total -= 1;
        }
    }
}

impl Admission {
    pub fn new(limits: Limits) -> Arc<Admission> {
        Arc::new(Admission {
            limits,
            counts: Mutex::new(Counts::default()),
        })
    }

    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// A slot for a handshake from `ip`, or None when it has too many.
    pub fn handshake(self: &Arc<Self>, ip: IpAddr) -> Option<Ticket> {
        let mut c = self.counts.lock().unwrap();
        let n = c.handshakes.entry(ip).or_default();
        if *n >= self.limits.handshakes_per_ip {
            return None;
        }
        *n += 1;
        Some(Ticket {
            admission: self.clone(),
            ip,
            slot: Slot::Handshake,
        })
    }

    /// A slot for a connection without a certificate from `ip`, or None.
    pub fn anonymous(self: &Arc<Self>, ip: IpAddr) -> Option<Ticket> {
        let mut c = self.counts.lock().unwrap();
        if c.anonymous_total >= self.limits.anonymous_total {
            return None;
        }
        let n = c.anonymous.entry(ip).or_default();
        if *n >= self.limits.anonymous_per_ip {
            return None;
        }
        *n += 1;
        c.anonymous_total += 1;
        Some(Ticket {
            admission: self.clone(),
            ip,
            slot: Slot::Anonymous,
        })
    }

    /// A slot for a shed connection (one over the anonymous caps), or None.
    pub fn shed(self: &Arc<Self>, ip: IpAddr) -> Option<Ticket> {
        let mut c = self.counts.lock().unwrap();
        if c.shed >= self.limits.shed_total {
            return None;
        }
        c.shed += 1;
        Some(Ticket {
            admission: self.clone(),
            ip,
            slot: Slot::Shed,
        })
    }

    /// What a shed connection's calls are told.
    pub fn shed_message(&self) -> String {
        format!(
            "the controller holds as many connections without a client certificate as it allows ({} per address, \
             {} in all); retry in a few seconds",
            self.limits.anonymous_per_ip, self.limits.anonymous_total
        )
    }
}

/// A connection of the mTLS listener; gives its admission slot back when
/// it goes. Its server says goodbye (a GOAWAY at the end of its lifetime,
/// `server.rs`); `hard_stop`, if any, is when it is closed whatever is
/// still open on it: it then reads end-of-stream.
pub struct Conn {
    inner: TlsStream<TcpStream>,
    hard_stop: Option<Pin<Box<tokio::time::Sleep>>>,
    _ticket: Option<Ticket>,
}

impl Conn {
    pub fn new(inner: TlsStream<TcpStream>, ticket: Option<Ticket>, hard_stop: Option<Duration>) -> Conn {
        Conn {
            inner,
            hard_stop: hard_stop.map(|d| Box::pin(tokio::time::sleep(d))),
            _ticket: ticket,
        }
    }
}

impl AsyncRead for Conn {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        if let Some(d) = self.hard_stop.as_mut()
            && d.as_mut().poll(cx).is_ready()
        {
            return Poll::Ready(Ok(())); // end of stream
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for Conn {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

impl Connected for Conn {
    type ConnectInfo = <TlsStream<TcpStream> as Connected>::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

/// The service of shed connections: every call gets `RESOURCE_EXHAUSTED`
/// with [`Admission::shed_message`] (its server soon closes the connection
/// with a GOAWAY, so the client retries over a new one).
#[derive(Clone, Debug)]
pub struct Shed {
    message: Arc<str>,
}

impl Shed {
    pub fn layer(admission: &Admission) -> impl tower::Layer<tonic::service::Routes, Service = Shed> + Clone + use<> {
        let message: Arc<str> = admission.shed_message().into();
        tower::layer::layer_fn(move |_routes| Shed {
            message: message.clone(),
        })
    }
}

impl<B> tower::Service<tonic::codegen::http::Request<B>> for Shed {
    type Response = tonic::codegen::http::Response<tonic::body::Body>;
    type Error = std::convert::Infallible;
    type Future = std::future::Ready<Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: tonic::codegen::http::Request<B>) -> Self::Future {
        std::future::ready(Ok(
            tonic::Status::resource_exhausted(self.message.to_string()).into_http()
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_capped_per_address_and_in_all_and_given_back() {
        let a = Admission::new(Limits {
            handshakes_per_ip: 2,
            anonymous_per_ip: 2,
            anonymous_total: 3,
            anonymous_lifetime: Duration::from_secs(1),
            anonymous_grace: Duration::from_secs(1),
            shed_total: 1,
            shed_lifetime: Duration::from_secs(1),
            shed_grace: Duration::from_secs(1),
        });
        let (x, y): (IpAddr, IpAddr) = ("192.0.2.1".parse().unwrap(), "192.0.2.2".parse().unwrap());
        let h = [a.handshake(x), a.handshake(x)];
        assert!(h.iter().all(Option::is_some));
        assert!(a.handshake(x).is_none(), "a third handshake from one address");
        assert!(a.handshake(y).is_some(), "another address is not held up");
        let x1 = a.anonymous(x).unwrap();
        let _x2 = a.anonymous(x).unwrap();
        assert!(a.anonymous(x).is_none(), "per address");
        let _y1 = a.anonymous(y).unwrap();
        assert!(a.anonymous(y).is_none(), "in all");
        drop(x1);
        assert!(a.anonymous(y).is_some(), "a slot given back is free again");
        drop(h);
        assert!(a.handshake(x).is_some());
        let s = a.shed(x).unwrap();
        assert!(a.shed(y).is_none(), "shed connections are capped in all");
        drop(s);
        assert!(a.shed(y).is_some());
    }
}
