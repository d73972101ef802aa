//! Rotating a site's CA under traffic: site a of two peered sites starts a
//! rotation (`weft-controller ca rotate`, then a restart), its agents renew
//! under the new CA as they reconnect and take in both CAs, site b learns
//! the new CA over the federation stream, and `ca finish` (then a restart)
//! retires the old one. Pings across the peering lose nothing, every
//! certificate the site uses afterwards chains to the new CA, and a
//! certificate the old CA signs (a forged admin, as a leaked key would
//! make) is refused.

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

/// Site a's agents' state directories.
fn agents_of_a(s: &TwoSites) -> Vec<PathBuf> {
    s.agents
        .iter()
        .filter(|a| ["gwa", "na", "na2"].contains(&a.1))
        .map(|a| a.3.clone())
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

/// Calls site a's controller over TCP (from its host) with grpcurl,
/// trusting `ca` and presenting `cert` and `key`.
fn call(s: &mut TwoSites, grpcurl: &Path, ca: &Path, cert: &Path, key: &Path, method: &str) -> std::process::Output {
    let listen = s.lab.ctl(0).listen.clone();
    let (ca, cert, key) = (ca.to_str().unwrap(), cert.to_str().unwrap(), key.to_str().unwrap());
    s.lab.exec(
        &s.ns["ctla"],
        &[
            grpcurl.to_str().unwrap(),
            "-cacert",
            ca,
            "-cert",
            cert,
            "-key",
            key,
            "-max-time",
            "5",
            &listen,
            method,
        ],
    )
}

/// What site `site`'s peering with the other site shows.
fn peering(target: &str) -> serde_json::Value {
    weftctl_json(target, &["peerings"])["peerings"][0].clone()
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
    // What a thief of the old CA key could make: an admin certificate.
    let forged = s.dir.path().join("forged");
    std::fs::create_dir_all(&forged).unwrap();
    {
        let key = rcgen::KeyPair::from_pem(&std::fs::read_to_string(pki.join("ca.key")).unwrap()).unwrap();
        let issuer = rcgen::Issuer::from_ca_cert_der(&old_ca.clone().into(), key).unwrap();
        let mut p = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        p.subject_alt_names
            .push(rcgen::SanType::URI("weft://car-a/admin/admin".try_into().unwrap()));
        p.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth];
        let k = rcgen::KeyPair::generate().unwrap();
        let cert = p.signed_by(&k, &issuer).unwrap();
        std::fs::write(forged.join("admin.pem"), cert.pem()).unwrap();
        std::fs::write(forged.join("admin.key"), k.serialize_pem()).unwrap();
    }
    let (ping, ping_log) = ping_wa_to_wb(&mut s, "ca-rotation-ping.log");

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
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let status = loop {
        let o = s.lab.ctl(0).run_command(&["ca", "status"]);
        let text = format!("{}{}", stdout(&o), stderr(&o));
        if o.status.success() && !text.contains("on the old CA") && !text.contains("peer not told") {
            break text;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "agents or peers of site a still on the old CA after 60 s:\n{text}"
        );
        std::thread::sleep(Duration::from_millis(250));
    };
    assert!(status.contains(&new_fp) && status.contains("also trusted"), "{status}");
    for dir in agents_of_a(&s) {
        assert!(
            signed_by(&dir.join("agent.pem"), &new_ca),
            "{}: not renewed",
            dir.display()
        );
        assert_eq!(certs(&dir.join("ca.pem")).len(), 2, "{}: trusts both", dir.display());
    }
    assert_eq!(
        peering(&s.tb)["remote_ca_fingerprint"],
        new_fp.as_str(),
        "site b's record of a's CA"
    );
    // During the overlap a certificate of the old CA still counts.
    let (ca_pem, admin, admin_key) = (pki.join("ca.pem"), pki.join("admin.pem"), pki.join("admin.key"));
    let get_site = "weft.v1.AdminService/GetSite";
    let o = call(
        &mut s,
        &grpcurl,
        &ca_pem,
        &forged.join("admin.pem"),
        &forged.join("admin.key"),
        get_site,
    );
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
                .all(|d| certs(&d.join("ca.pem")) == vec![new_ca.clone()])
                .then_some(())
        },
    );
    for f in [pki.join("server.pem"), admin.clone()] {
        assert!(signed_by(&f, &new_ca), "{}", f.display());
    }
    for dir in agents_of_a(&s) {
        assert!(signed_by(&dir.join("agent.pem"), &new_ca), "{}", dir.display());
    }
    let o = call(
        &mut s,
        &grpcurl,
        &ca_pem,
        &forged.join("admin.pem"),
        &forged.join("admin.key"),
        get_site,
    );
    assert!(
        !o.status.success(),
        "the old CA's certificate was taken: {}",
        stdout(&o)
    );
    // (grpcurl, as Go's TLS does, sends no certificate that none of the
    // CAs the server names issued; a client that sends it anyway is told
    // the CA is not trusted.)
    let e = stderr(&o);
    assert!(
        e.contains("Unauthenticated")
            && (e.contains("not issued by a CA this site trusts") || e.contains("needs a client certificate")),
        "{e}"
    );
    let o = call(&mut s, &grpcurl, &ca_pem, &admin, &admin_key, get_site);
    assert!(o.status.success(), "the new admin bundle: {}", stderr(&o));
    // The peering stays up both ways with the new CA alone.
    eventually("the peering connected on both sides", Duration::from_secs(30), || {
        let (a, b) = (peering(&s.ta), peering(&s.tb));
        (a["state"] == "connected" && b["state"] == "connected" && b["remote_ca_fingerprint"] == new_fp.as_str())
            .then_some(())
    });
    let status = ca(&mut s, &["status"]);
    assert!(
        !status.contains("also trusted") && status.contains("retired"),
        "{status}"
    );

    std::thread::sleep(Duration::from_secs(2));
    s.lab.proc(ping).stop();
    let (answered, lost) = weft_tests::pings_lost(&std::fs::read_to_string(&ping_log).unwrap(), 100);
    eprintln!("CA rotation: {answered} pings answered at 50 Hz, {lost} lost");
    assert_eq!(lost, 0, "pings lost across the CA rotation");
}
