//! Rotating a site's CA under traffic, in its two modes.
//!
//! With an overlap: site a of two peered sites starts a rotation
//! (`weft-controller ca rotate`, then a restart), its agents renew under
//! the new CA as they reconnect and take in both CAs, site b learns the new
//! CA over the federation stream, and `ca finish` (then a restart) retires
//! the old one. Pings across the peering lose nothing, every certificate
//! the site uses afterwards chains to the new CA, and a certificate the old
//! CA signs (a forged admin, as a leaked key would make) is refused.
//!
//! With `--revoke-old` (the key leaked): the old CA is refused from the
//! restart on, and agents and the peer follow by hand; the pings' longest
//! silence is the outage.

use std::path::{Path, PathBuf};
use std::time::Duration;

use weft_tests::sites::{self, TwoSites, ping_wa_to_wb, until_wa_reaches_wb};
use weft_tests::{eventually, stderr, stdout, step, weftctl_json};

/// The certificates in a PEM file (DER).
fn certs(path: &Path) -> Vec<Vec<u8>> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    let pem = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    CertificateDer::pem_slice_iter(&pem)
        .map(|c| c.unwrap().to_vec())
        .collect()
}

/// Whether the first certificate in `path` was signed by the CA `ca`.
fn signed_by(path: &Path, ca: &[u8]) -> bool {
    use x509_parser::prelude::{FromDer, X509Certificate};
    let leaf = certs(path).into_iter().next().expect("a certificate");
    let (_, leaf) = X509Certificate::from_der(&leaf).unwrap();
    let (_, ca) = X509Certificate::from_der(ca).unwrap();
    leaf.verify_signature(Some(ca.public_key())).is_ok()
}

fn fingerprint(der: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(der).iter().map(|b| format!("{b:02x}")).collect()
}

/// Site a's agents: (process index, host, kind, state directory).
fn agents_of_a(s: &TwoSites) -> Vec<(usize, &'static str, &'static str, PathBuf)> {
    s.agents
        .iter()
        .filter(|a| ["gwa", "na", "na2"].contains(&a.1))
        .cloned()
        .collect()
}

/// `weft-controller ca SUBCOMMAND` for site a's controller; asserts it
/// succeeded and returns what it printed.
fn ca(s: &mut TwoSites, args: &[&str]) -> String {
    let mut all = vec!["ca"];
    all.extend_from_slice(args);
    let o = s.lab.ctl(0).run_command(&all);
    assert!(o.status.success(), "ca {args:?}: {}{}", stdout(&o), stderr(&o));
    stdout(&o)
}

/// What a thief of the site CA key in `pki` could make: an admin
/// certificate of `site`, in a directory of its own (admin.pem, admin.key).
fn forge_admin(s: &TwoSites, pki: &Path, site: &str) -> PathBuf {
    let forged = s.dir.path().join("forged");
    std::fs::create_dir_all(&forged).unwrap();
    let ca = certs(&pki.join("ca.pem")).remove(0);
    let key = rcgen::KeyPair::from_pem(&std::fs::read_to_string(pki.join("ca.key")).unwrap()).unwrap();
    let issuer = rcgen::Issuer::from_ca_cert_der(&ca.into(), key).unwrap();
    let mut p = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    let uri = format!("weft://{site}/admin/admin");
    p.subject_alt_names
        .push(rcgen::SanType::URI(uri.as_str().try_into().unwrap()));
    p.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth];
    let k = rcgen::KeyPair::generate().unwrap();
    let cert = p.signed_by(&k, &issuer).unwrap();
    std::fs::write(forged.join("admin.pem"), cert.pem()).unwrap();
    std::fs::write(forged.join("admin.key"), k.serialize_pem()).unwrap();
    forged
}

/// Calls `GetSite` on site a's controller over TCP (from its host) with
/// grpcurl, trusting the site's CAs and presenting the admin bundle in
/// `dir`.
fn get_site(s: &mut TwoSites, grpcurl: &Path, dir: &Path) -> std::process::Output {
    let listen = s.lab.ctl(0).listen.clone();
    let ca = s.lab.ctl(0).data_dir.join("pki").join("ca.pem");
    let (cert, key) = (dir.join("admin.pem"), dir.join("admin.key"));
    let args = [
        grpcurl.to_str().unwrap(),
        "-cacert",
        ca.to_str().unwrap(),
        "-cert",
        cert.to_str().unwrap(),
        "-key",
        key.to_str().unwrap(),
        "-max-time",
        "5",
        &listen,
        "weft.v1.AdminService/GetSite",
    ];
    s.lab.exec(&s.ns["ctla"], &args)
}

/// Asserts that a call was refused for its certificate. (grpcurl, as
/// Go's TLS does, sends no certificate that none of the CAs the server
/// names issued; a client that sends it anyway is told the CA is not
/// trusted.)
fn refused(o: &std::process::Output) {
    assert!(!o.status.success(), "the old CA's certificate was taken: {}", stdout(o));
    let e = stderr(o);
    assert!(
        e.contains("Unauthenticated")
            && (e.contains("not issued by a CA this site trusts") || e.contains("needs a client certificate")),
        "{e}"
    );
}

/// What a site's peering with the other site shows.
fn peering(target: &str) -> serde_json::Value {
    weftctl_json(target, &["peerings"])["peerings"][0].clone()
}

/// Waits until site a's `ca status` lists no agent and no peer on an
/// older CA and the peering is connected on both sides; returns the status.
fn until_all_follow(s: &mut TwoSites, within: Duration) -> String {
    let deadline = std::time::Instant::now() + within;
    loop {
        let o = s.lab.ctl(0).run_command(&["ca", "status"]);
        let text = format!("{}{}", stdout(&o), stderr(&o));
        let (a, b) = (peering(&s.ta), peering(&s.tb));
        let connected = a["state"] == "connected" && b["state"] == "connected";
        if o.status.success() && connected && !text.contains("on the old CA") && !text.contains("peer not told") {
            return text;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "site a's agents or peer still on an older CA, or the peering down, after {within:?}:\n{text}\n{a}\n{b}"
        );
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// Stops the pings and returns (answered, lost, longest silence in s since
/// `from`).
fn pings(s: &mut TwoSites, ping: usize, log: &Path, from: f64) -> (usize, usize, f64) {
    std::thread::sleep(Duration::from_secs(2));
    s.lab.proc(ping).stop();
    let (gap, _) = sites::longest_gap(log, from);
    let (answered, lost) = weft_tests::pings_lost(&std::fs::read_to_string(log).unwrap(), 100);
    (answered, lost, gap)
}

#[test]
#[ignore = "needs root (network namespaces): tests/run.sh runs it as root"]
fn a_site_ca_is_rotated_under_traffic_without_losing_a_ping_and_the_old_ca_is_refused_after() {
    if !weft_tests::netns::require_root() {
        return;
    }
    let Some(grpcurl) = weft_tests::require_tool("grpcurl") else {
        return;
    };
    let mut s = sites::up("car", ("car-a", "10.1.0.0/16"), ("car-b", "10.2.0.0/16"));
    until_wa_reaches_wb(&s);
    let pki = s.lab.ctl(0).data_dir.join("pki");
    let old_ca = certs(&pki.join("ca.pem")).remove(0);
    let forged = forge_admin(&s, &pki, "car-a");
    let (ping, ping_log) = ping_wa_to_wb(&mut s, "ca-rotation-ping.log");
    let from = weft_tests::unix_now();

    step("rotate: a new CA signs from the restart, the old one stays trusted");
    let said = ca(&mut s, &["rotate"]);
    assert!(said.contains("new CA:"), "{said}");
    let trusted = certs(&pki.join("ca.pem"));
    assert_eq!(trusted.len(), 2, "the new CA and the old one");
    assert_eq!(trusted[1], old_ca);
    let new_ca = trusted[0].clone();
    let new_fp = fingerprint(&new_ca);
    s.lab.ctl(0).restart();

    step("agents renew under the new CA, and site b learns it");
    let status = until_all_follow(&mut s, Duration::from_secs(60));
    assert!(status.contains(&new_fp) && status.contains("also trusted"), "{status}");
    for (_, host, _, dir) in agents_of_a(&s) {
        assert!(signed_by(&dir.join("agent.pem"), &new_ca), "{host}: not renewed");
        assert_eq!(certs(&dir.join("ca.pem")).len(), 2, "{host}: trusts both");
    }
    assert_eq!(
        peering(&s.tb)["remote_ca_fingerprint"],
        new_fp.as_str(),
        "site b's record of a's CA"
    );
    // During the overlap a certificate of the old CA still counts.
    let o = get_site(&mut s, &grpcurl, &forged);
    assert!(o.status.success(), "{}", stderr(&o));

    step("finish: the old CA is retired");
    let said = ca(&mut s, &["finish"]);
    assert!(
        said.contains(&format!("retired:          {}", fingerprint(&old_ca))),
        "{said}"
    );
    s.lab.ctl(0).restart();
    assert_eq!(certs(&pki.join("ca.pem")), vec![new_ca.clone()]);
    eventually(
        "site a's agents trusting the new CA alone",
        Duration::from_secs(30),
        || {
            agents_of_a(&s)
                .iter()
                .all(|a| certs(&a.3.join("ca.pem")) == vec![new_ca.clone()])
                .then_some(())
        },
    );
    for f in [pki.join("server.pem"), pki.join("admin.pem")] {
        assert!(signed_by(&f, &new_ca), "{}", f.display());
    }
    for (_, host, _, dir) in agents_of_a(&s) {
        assert!(signed_by(&dir.join("agent.pem"), &new_ca), "{host}");
    }
    refused(&get_site(&mut s, &grpcurl, &forged));
    let o = get_site(&mut s, &grpcurl, &pki);
    assert!(o.status.success(), "the new admin bundle: {}", stderr(&o));
    // The peering stays up both ways with the new CA alone.
    let status = until_all_follow(&mut s, Duration::from_secs(30));
    assert!(
        !status.contains("also trusted") && status.contains("retired"),
        "{status}"
    );
    assert_eq!(peering(&s.tb)["remote_ca_fingerprint"], new_fp.as_str());

    let (answered, lost, gap) = pings(&mut s, ping, &ping_log, from);
    eprintln!("CA rotation: {answered} pings answered at 50 Hz, {lost} lost, longest silence {gap:.3} s");
    assert_eq!(lost, 0, "pings lost across the CA rotation");
}

/// The leaked-key mode: `ca rotate --revoke-old` retires the old CA at the
/// controller's restart. A certificate it signed is refused at once; the
/// site's agents, which trust only the old CA, cannot verify the
/// controller and keep forwarding what they have until each is given a
/// new token and restarted (it enrolls again, keeping its record and what
/// it applied); the peer keeps the tunnel until its admin sets the new CA
/// by hand. The pings' longest silence through all of it is the outage.
#[test]
#[ignore = "needs root (network namespaces): tests/run.sh runs it as root"]
fn a_leaked_site_ca_is_retired_at_once_and_agents_and_peers_follow_by_hand() {
    if !weft_tests::netns::require_root() {
        return;
    }
    let Some(grpcurl) = weft_tests::require_tool("grpcurl") else {
        return;
    };
    let mut s = sites::up("cav", ("cav-a", "10.1.0.0/16"), ("cav-b", "10.2.0.0/16"));
    until_wa_reaches_wb(&s);
    let pki = s.lab.ctl(0).data_dir.join("pki");
    let forged = forge_admin(&s, &pki, "cav-a");
    let (ping, ping_log) = ping_wa_to_wb(&mut s, "ca-revoke-ping.log");
    let from = weft_tests::unix_now();

    step("rotate with --revoke-old and restart: the old CA is refused at once");
    let said = ca(&mut s, &["rotate", "--revoke-old"]);
    assert!(
        said.contains("enroll every agent again") && said.contains("peering set-ca"),
        "{said}"
    );
    let new_ca = certs(&pki.join("ca.pem"));
    assert_eq!(new_ca.len(), 1, "the new CA alone");
    let new_fp = fingerprint(&new_ca[0]);
    s.lab.ctl(0).restart();
    refused(&get_site(&mut s, &grpcurl, &forged));
    let o = get_site(&mut s, &grpcurl, &pki);
    assert!(o.status.success(), "the new admin bundle: {}", stderr(&o));

    step("each agent of site a, given a new token, enrolls again");
    for (proc, host, kind, dir) in agents_of_a(&s) {
        let name = if kind == "gateway" { "gw" } else { host };
        let t = weftctl_json(&s.ta, &["token", "create", "--role", kind, "--name", name]);
        s.lab.set_arg(proc, "--token", t["token"].as_str().unwrap());
        s.lab.set_arg(proc, "--ca-fingerprint", &new_fp);
        s.lab.proc(proc).stop();
        s.lab.respawn(proc);
        eventually(
            &format!("{host} enrolled under the new CA"),
            Duration::from_secs(30),
            || signed_by(&dir.join("agent.pem"), &new_ca[0]).then_some(()),
        );
        assert_eq!(certs(&dir.join("ca.pem")), new_ca, "{host} trusts the new CA alone");
    }

    step("site b's admin sets site a's new CA");
    let copy = s.dir.path().join("cav-a-ca.pem");
    std::fs::copy(pki.join("ca.pem"), &copy).unwrap();
    let set = weftctl_json(&s.tb, &["peering", "set-ca", "cav-a", copy.to_str().unwrap()]);
    assert_eq!(set["remote_ca_fingerprint"], new_fp.as_str(), "{set}");
    let status = until_all_follow(&mut s, Duration::from_secs(60));
    assert!(status.contains("retired"), "{status}");

    let (answered, lost, gap) = pings(&mut s, ping, &ping_log, from);
    eprintln!(
        "CA rotation with --revoke-old: {answered} pings answered at 50 Hz, {lost} lost, longest silence {gap:.3} s \
         (each agent of the site enrolled again in turn)"
    );
    // What enrolling again costs: the gateway agent restarted (its
    // userspace tunnels live in its process); nodes lose nothing.
    assert!(gap < 2.0, "traffic stopped for {gap:.3} s");
}
