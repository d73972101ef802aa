//! A gateway's endpoint discovery, from its reports into its record.

use weft_proto::v1 as pb;

use super::AgentApi;

impl AgentApi {
    /// Records what the gateway's endpoint discovery found, per peering
    /// port, when it changed, in a task of its own: never at the
    /// heartbeat's cost (a slow store would delay the liveness the report
    /// carries); a write that fails is tried again at the next report. A
    /// tunnel whose candidates do not pass the checks records nothing (and
    /// is logged): a gateway's report is checked like a peer's parameters.
    pub(super) fn record_discovery(&self, name: &str, tunnels: &[pb::TunnelStatus]) {
        let model = self.hub.model();
        let Some(g) = model.gateways.get(name) else {
            return;
        };
        // What was recorded stays until a report says otherwise (a gateway
        // that restarted reports its tunnels before it probed again); a
        // port no peering listens on any more goes.
        let mut found: std::collections::BTreeMap<u16, weft_core::nat::Discovered> = g
            .discovered
            .iter()
            .filter(|(port, _)| model.peerings.values().any(|p| p.listen_port == **port))
            .map(|(port, d)| (*port, d.clone()))
            .collect();
        for t in tunnels {
            let Some(p) = model.peerings.get(&t.peer_site) else {
                continue;
            };
            let nat = weft_core::nat::Behaviour::parse(&t.nat);
            match (
                weft_core::nat::candidates("tunnels.candidates", &t.candidates, &[]),
                nat,
            ) {
                (Ok(candidates), Ok(nat)) if !candidates.is_empty() || nat.is_some() => {
                    found.insert(p.listen_port, weft_core::nat::Discovered { candidates, nat });
                }
                (Ok(_), Ok(_)) => {}
                (Err(e), _) | (_, Err(e)) => {
                    tracing::warn!(gateway = name, peer = %t.peer_site, error = %e, "endpoint discovery report refused");
                }
            }
        }
        if found == g.discovered || !self.recording.lock().unwrap().insert(name.to_string()) {
            return;
        }
        let (state, recording, name) = (self.state.clone(), self.recording.clone(), name.to_string());
        tokio::spawn(async move {
            if let Err(e) = state.set_discovered(&name, found).await {
                tracing::warn!(gateway = %name, error = %e, "endpoint discovery not recorded yet");
            }
            recording.lock().unwrap().remove(&name);
        });
    }
}
