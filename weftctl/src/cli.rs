//! weftctl's command line: every command and flag.

use std::path::PathBuf;

use clap::{Parser, Subcommand, ValueEnum};

#[derive(Parser, Debug)]
#[command(name = "weftctl", version, about = "Administer a weft site controller")]
pub struct Cli {
    /// Controller address: unix:PATH (local admin socket) or https://HOST:PORT.
    #[arg(
        long,
        env = "WEFT_CONTROLLER",
        default_value = "unix:/var/lib/weft/admin.sock",
        global = true
    )]
    pub controller: String,
    /// Output format.
    #[arg(long, short, env = "WEFT_OUTPUT", value_enum, default_value_t = Output::Table, global = true)]
    pub output: Output,
    /// Site CA certificate (PEM), for https:// controllers.
    #[arg(long, env = "WEFT_CA_FILE", global = true)]
    pub ca_file: Option<PathBuf>,
    /// Client certificate (PEM), for https:// controllers.
    #[arg(long, env = "WEFT_CERT", global = true)]
    pub cert: Option<PathBuf>,
    /// Client key (PEM), for https:// controllers.
    #[arg(long, env = "WEFT_KEY", global = true)]
    pub key: Option<PathBuf>,
    #[command(subcommand)]
    pub command: Cmd,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Output {
    Table,
    Json,
}

#[derive(Subcommand, Debug)]
pub enum Cmd {
    /// Show the site's configuration.
    Site,
    /// Show which releases run where (this client, the controller, each
    /// agent, each peer) and which are outside the supported skew.
    Version,
    /// List nodes.
    Nodes,
    /// Show, add or remove one node.
    #[command(subcommand)]
    Node(NodeCmd),
    /// List gateways.
    Gateways,
    /// Remove a gateway.
    #[command(subcommand)]
    Gateway(GatewayCmd),
    /// Create, list or delete enrollment tokens.
    #[command(subcommand)]
    Token(TokenCmd),
    /// List peerings with their local views.
    Peerings,
    /// Create or delete a peering with another site.
    #[command(subcommand)]
    Peering(PeeringCmd),
    /// List IPAM allocations and pool usage.
    Allocations,
    /// One screen: the site, gateways (active/standby), nodes, peerings.
    Status,
    /// Check what breaks fabrics (certificates, lagging agents, tunnel MTU,
    /// overlapping routes, kernel features, clock skew). Exit status: 0 when
    /// no check FAILs (WARNs allowed), 1 when one does (the report is
    /// printed whole either way, and the failed checks are named on
    /// stderr), 2 when the controller could not be asked (no report).
    Diagnose {
        /// How long to watch agents behind the latest revision before calling them lagging.
        #[arg(long, default_value = "2s")]
        settle: humantime::Duration,
    },
    /// Test the data path.
    #[command(subcommand)]
    Test(TestCmd),
    /// Draw the federation: sites, gateways, nodes, peerings with state and RTT.
    Topology {
        #[arg(long, value_enum, default_value = "dot")]
        format: TopologyFormat,
    },
    /// Serve a live, read-only page of this site's fabric (peerings and
    /// their paths, gateways, nodes, diagnose, recent events) on 127.0.0.1,
    /// for a browser on this host. It prints a link with a one-time token;
    /// the page reads the controller with weftctl's own credentials, so the
    /// controller serves nothing new. Runs until Ctrl-C.
    Ui {
        /// Where to listen: a loopback address and port (port 0: any free
        /// one). Reach it from elsewhere through an SSH tunnel.
        #[arg(long, default_value = "127.0.0.1:0")]
        listen: std::net::SocketAddr,
        /// Print the link only; do not open a browser.
        #[arg(long)]
        no_open: bool,
        /// How often to read the controller (the page is at most this
        /// much behind it, plus the browser's update).
        #[arg(long, default_value = "1s")]
        interval: humantime::Duration,
    },
    /// Translate an address (IPv4 or IPv6): `translate SITE ADDRESS` gives
    /// the address this site reaches a peer's ADDRESS (as that site uses it)
    /// at; `translate ADDRESS` gives the peer and real address behind an
    /// address of a local view.
    Translate {
        #[arg(num_args = 1..=2, value_names = ["SITE", "ADDRESS"])]
        args: Vec<String>,
    },
    /// List the names this site publishes and those peers published, with
    /// the address each resolves to here (NAME.SITE.<zone> on every node's
    /// DNS responder).
    Names,
    /// Publish or unpublish a name.
    #[command(subcommand)]
    Name(NameCmd),
    /// Show the local view this site would give a peer's CIDRs now (writes nothing).
    PlanView {
        /// The peer's workload CIDR; repeatable.
        #[arg(long = "workload-cidr", required = true, value_delimiter = ',')]
        workload_cidrs: Vec<String>,
        /// The peer's external CIDR.
        #[arg(long)]
        external_cidr: Option<String>,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum TopologyFormat {
    Dot,
    Svg,
}

#[derive(Subcommand, Debug)]
pub enum TestCmd {
    /// From this host or its namespaces, reach peers' workloads through this
    /// site's local views (ICMP, and TCP with --tcp-port); prints a matrix,
    /// exits 1 naming each pair that failed. Needs root (raw ICMP, setns).
    Network {
        /// Where to probe from: "host" (where weftctl runs), a network
        /// namespace name, or a path like /proc/PID/ns/net. Repeatable [default: host].
        #[arg(long, value_delimiter = ',')]
        from: Vec<String>,
        /// A peer's workload as SITE=ADDRESS, the address as that site uses
        /// it (weftctl maps it to the local view): IPv4, or IPv6 written
        /// SITE=[fd00::10]. Repeatable.
        #[arg(long, value_delimiter = ',')]
        to: Vec<String>,
        /// Also connect over TCP to this port (a refused connection counts
        /// as reached: the workload itself answered).
        #[arg(long)]
        tcp_port: Option<u16>,
        /// How long to wait for each answer.
        #[arg(long, default_value = "2s")]
        timeout: humantime::Duration,
    },
}

#[derive(Subcommand, Debug)]
pub enum NodeCmd {
    /// Show one node.
    Get { name: String },
    /// Add a node; it gets the next free subnet unless --subnet declares one.
    Add {
        name: String,
        /// A subnet the node already has (inside a pod CIDR).
        #[arg(long)]
        subnet: Option<String>,
    },
    /// Remove a node and release its subnet.
    Remove { name: String },
}

#[derive(Subcommand, Debug)]
pub enum PeeringCmd {
    /// Print a one-time token another site uses to peer with this one.
    Token {
        /// Lifetime, e.g. 30m, 1h.
        #[arg(long, default_value = "1h")]
        ttl: String,
        /// Only this site may redeem it (recommended: a leaked token is
        /// then useless to anyone else).
        #[arg(long = "for")]
        for_site: Option<String>,
    },
    /// Peer with the site that made the token. A peer that is slow to
    /// answer or cannot be reached yet is asked again, with backoff, until
    /// --timeout: repeating a peering with the same token is safe.
    Create {
        #[arg(long)]
        token: String,
        /// How long to keep trying while the peer is slow or unreachable
        /// (DEADLINE_EXCEEDED, UNAVAILABLE); 0s: try once.
        #[arg(long, default_value = "60s")]
        timeout: humantime::Duration,
        /// Agree to transit on this peering (see `weftctl peering transit`).
        #[arg(long)]
        transit: bool,
    },
    /// Agree (on) or not (off) to transit on the peering with SITE: this
    /// site then forwards between SITE and its other transit peers, and
    /// reaches SITE's other transit peers through it. A hop is used once
    /// both of its ends agree; a direct peering is preferred over it.
    Transit {
        site: String,
        #[arg(value_parser = ["on", "off"])]
        state: String,
    },
    /// End the peering with a site, on both sides.
    Delete { site: String },
    /// Route the CIDRs a peer announced after negotiation (shown as
    /// pending in `weftctl peerings`).
    Accept { site: String },
    /// Trust the CA in FILE (a copy of the peer site's pki/ca.pem) for
    /// SITE from now on: after SITE retired its CA at once
    /// (`weft-controller ca rotate --revoke-old`). Check its fingerprint
    /// with SITE's admin first.
    SetCa {
        site: String,
        #[arg(value_name = "FILE")]
        ca_file: PathBuf,
    },
    /// What a peer may reach of this site: set or show the peering's
    /// export policy (this site decides; the peer cannot widen it).
    #[command(subcommand)]
    Policy(PolicyCmd),
}

#[derive(Subcommand, Debug)]
pub enum PolicyCmd {
    /// Set the export policy of the peering with SITE: exactly one of
    /// --allow (repeatable), --all, --none or --site-default. Applied at
    /// the gateway within seconds; the tunnel stays up and open
    /// connections the new policy allows stay open.
    #[command(group(clap::ArgGroup::new("what").required(true).args(["allow", "all", "none", "site_default"])))]
    Set {
        site: String,
        /// Allow CIDR[,PROTOCOL[,PORT[-PORT]]]: a prefix of this site's
        /// workload or external CIDRs (IPv4 or IPv6), optionally tcp, udp
        /// or icmp (ICMPv6 for an IPv6 prefix), and for tcp or udp a port
        /// or range, e.g. 10.1.2.0/24,tcp,8080 or fd00:1:0:2::/64,icmp.
        #[arg(long, value_name = "RULE")]
        allow: Vec<String>,
        /// Everything: the site's workload and external CIDRs and exported hosts.
        #[arg(long)]
        all: bool,
        /// Nothing (replies to this site's own connections still pass).
        #[arg(long)]
        none: bool,
        /// Follow the site's --default-export.
        #[arg(long = "site-default")]
        site_default: bool,
    },
    /// Show the export policy of the peering with SITE.
    Show { site: String },
}

#[derive(Subcommand, Debug)]
pub enum NameCmd {
    /// Publish NAME for a workload's ADDRESS (in the pod CIDRs; an IPv6
    /// one alone on an IPv6-only site), or with --export for a host outside
    /// them (on the site's LAN, reached from the gateways): peers reach it
    /// through an address of the external CIDR.
    Add {
        name: String,
        address: String,
        #[arg(long)]
        export: bool,
        /// The workload's IPv6 address too (in the site's IPv6 pod CIDRs):
        /// peers that negotiated IPv6 answer AAAA for the name.
        #[arg(long = "address-v6", conflicts_with = "export")]
        address_v6: Option<String>,
    },
    /// Unpublish a name.
    Delete { name: String },
}

#[derive(Subcommand, Debug)]
pub enum GatewayCmd {
    /// Remove a gateway and revoke its certificate.
    Remove { name: String },
    /// Take the new WireGuard key a gateway asked for (held until then,
    /// so that a stolen gateway certificate cannot redirect the tunnels).
    /// KEY is the key the gateway's host logged ("this gateway's
    /// WireGuard public key"): a key asked for from elsewhere is refused.
    AcceptKey { name: String, key: String },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum RoleArg {
    Node,
    Gateway,
}

#[derive(Subcommand, Debug)]
pub enum TokenCmd {
    /// Create a token an agent enrolls with (shown once).
    Create {
        #[arg(long, value_enum)]
        role: RoleArg,
        /// Fix the agent's name (otherwise the agent's --name or host name).
        #[arg(long)]
        name: Option<String>,
        /// Lifetime, e.g. 30m, 1h, 7d.
        #[arg(long, default_value = "1h")]
        ttl: String,
        /// How many agents may enroll with it.
        #[arg(long, default_value_t = 1)]
        uses: u32,
    },
    /// List tokens (their secrets are never shown again).
    List,
    /// Delete a token.
    Delete { id: String },
}
