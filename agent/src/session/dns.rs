//! The node's DNS responder as a session keeps it: its records follow the
//! desired state, and with `--dns-listen subnet` its address follows the
//! node's subnet.

use super::Subnets;
use super::report::AbortOnDrop;
use crate::desired::Desired;

/// The node's DNS responder: its records (kept equal to the desired
/// state's `DnsRecord` objects) and the socket it serves on.
pub(crate) struct Dns {
    cfg: crate::dns::Config,
    pub(super) table: crate::dns::Table,
    running: Option<(std::net::SocketAddr, AbortOnDrop)>,
}

impl Dns {
    /// A responder with `cfg`, answering from `desired` until a controller
    /// does; serving at once when its address is fixed.
    pub(crate) fn start(cfg: &crate::dns::Config, desired: &Desired) -> anyhow::Result<Dns> {
        let mut d = Dns {
            cfg: cfg.clone(),
            table: Default::default(),
            running: None,
        };
        // What was stored resolves before any controller answers.
        d.table
            .set(desired.objects.values().filter_map(crate::desired::Held::object));
        if let crate::dns::Listen::At(addr) = cfg.listen {
            d.listen(addr)
                .map_err(|e| anyhow::anyhow!("--dns-listen {addr}: cannot listen: {e}"))?;
        }
        Ok(d)
    }

    /// Serves on `addr` (moving there if it served elsewhere).
    fn listen(&mut self, addr: std::net::SocketAddr) -> std::io::Result<()> {
        if self.running.as_ref().is_some_and(|(a, _)| *a == addr) {
            return Ok(());
        }
        self.running = None;
        let sock = crate::dns::bind(addr)?;
        tracing::info!(listen = %addr, zone = %self.cfg.zone, "DNS responder listening");
        let task = tokio::spawn(crate::dns::serve(sock, self.cfg.zone.clone(), self.table.clone()));
        self.running = Some((addr, AbortOnDrop(task)));
        Ok(())
    }

    /// Whether it listens on the first address of the node's subnet
    /// (`--dns-listen subnet`), which each session asks the controller for.
    pub(super) fn wants_subnet(&self) -> bool {
        self.cfg.listen == crate::dns::Listen::Subnet
    }

    /// With `--dns-listen subnet`: serves on the first address of the
    /// node's IPv4 subnet (of its IPv6 one on an IPv6-only site), port 53.
    pub(super) fn follow_subnet(&mut self, subnets: &Subnets) {
        if !self.wants_subnet() {
            return;
        }
        let subnet = if subnets.v4.is_empty() {
            &subnets.v6
        } else {
            &subnets.v4
        };
        let first = match crate::desired::first_address(subnet) {
            Ok((first, _)) => first,
            Err(e) => {
                tracing::warn!(%subnet, "the DNS responder waits: {e:#}");
                return;
            }
        };
        if let Err(e) = self.listen(std::net::SocketAddr::new(first, 53)) {
            tracing::error!(address = %first, error = %e, "the DNS responder cannot listen on the subnet's first address, port 53");
        }
    }
}
