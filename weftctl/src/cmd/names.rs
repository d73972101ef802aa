//! `weftctl translate`, `weftctl names`, `weftctl name add|delete`:
//! cross-site addressing.

use serde_json::json;
use weft_proto::v1 as pb;

use crate::cli::NameCmd;
use crate::out::*;

fn name_kind(v: i32) -> String {
    enum_name(
        pb::NameKind::try_from(v).unwrap_or_default().as_str_name(),
        "NAME_KIND_",
    )
}

fn translation_json(t: &pb::Translation) -> serde_json::Value {
    json!({"site": t.site, "real_address": t.real_address, "local_address": t.local_address,
           "kind": cidr_kind(t.kind), "real_cidr": t.real_cidr, "local_cidr": t.local_cidr, "remapped": t.remapped})
}

/// `translate SITE ADDRESS` (the peer's address → this site's view) or
/// `translate ADDRESS` (a local-view address → the peer's).
pub async fn translate(c: &mut Client, args: &[String]) -> Result<Out, String> {
    let (site, address) = match args {
        [a] => (String::new(), a.clone()),
        [s, a] => (s.clone(), a.clone()),
        _ => {
            return Err(
                "give SITE ADDRESS (a peer's address as that site uses it) or ADDRESS (an address of a local view)"
                    .into(),
            );
        }
    };
    let t = c
        .translate(pb::TranslateRequest { site, address })
        .await
        .map_err(status)?
        .into_inner();
    let mut rows = vec![
        vec!["site".into(), t.site.clone()],
        vec!["real address".into(), t.real_address.clone()],
        vec!["local address".into(), t.local_address.clone()],
        vec!["kind".into(), cidr_kind(t.kind)],
    ];
    rows.push(vec![
        "view".into(),
        format!(
            "{} -> {}{}",
            t.real_cidr,
            t.local_cidr,
            if t.remapped { " (remapped)" } else { "" }
        ),
    ]);
    Ok(Out {
        failed: false,
        json: translation_json(&t),
        header: vec![],
        rows,
        footer: vec![],
    })
}

/// A name's addresses of both families, those it has.
fn both(a: &str, v6: &str) -> String {
    [a, v6]
        .into_iter()
        .filter(|s| !s.is_empty())
        .collect::<Vec<_>>()
        .join(" ")
}

/// `names`: published and learned names.
pub async fn list(c: &mut Client) -> Result<Out, String> {
    let r = c
        .list_names(pb::ListNamesRequest {})
        .await
        .map_err(status)?
        .into_inner();
    let mut rows: Vec<Vec<String>> = r
        .published
        .iter()
        .map(|n| {
            let reached = if !n.external_address.is_empty() {
                format!("{} (host {})", n.external_address, n.address)
            } else {
                both(&n.address, &n.address_v6)
            };
            vec![
                "(this site)".into(),
                n.name.clone(),
                name_kind(n.kind),
                reached,
                "-".into(),
            ]
        })
        .collect();
    rows.extend(r.learned.iter().map(|n| {
        vec![
            n.site.clone(),
            n.name.clone(),
            name_kind(n.kind),
            both(&n.address, &n.address_v6),
            both(&n.local_address, &n.local_address_v6),
        ]
    }));
    Ok(Out {
        failed: false,
        json: json!({
            "published": r.published.iter().map(|n| json!({"name": n.name, "kind": name_kind(n.kind),
                "address": n.address, "address_v6": n.address_v6, "external_address": n.external_address,
                "created_at": ts(&n.created_at)}))
                .collect::<Vec<_>>(),
            "learned": r.learned.iter().map(|n| json!({"site": n.site, "name": n.name, "kind": name_kind(n.kind),
                "address": n.address, "local_address": n.local_address, "address_v6": n.address_v6,
                "local_address_v6": n.local_address_v6})).collect::<Vec<_>>(),
        }),
        header: vec!["SITE", "NAME", "KIND", "ADDRESS", "LOCAL ADDRESS"],
        rows,
        footer: vec![],
    })
}

/// `name add|delete`.
pub async fn run(c: &mut Client, cmd: &NameCmd) -> Result<Out, String> {
    match cmd {
        NameCmd::Add {
            name,
            address,
            export,
            address_v6,
        } => {
            // An IPv6 address alone: a workload of an IPv6-only site.
            let (address, address_v6) = match (address.contains(':'), address_v6) {
                (true, None) => (String::new(), address.clone()),
                (_, v6) => (address.clone(), v6.clone().unwrap_or_default()),
            };
            let n = c
                .create_name(pb::CreateNameRequest {
                    name: name.clone(),
                    address,
                    export: *export,
                    address_v6,
                })
                .await
                .map_err(status)?
                .into_inner();
            let mut out = text(if n.external_address.is_empty() {
                format!(
                    "published {} for {}",
                    n.name,
                    both(&n.address, &n.address_v6).replace(' ', " and ")
                )
            } else {
                format!(
                    "exported {} ({}) to peers at {} of the external CIDR",
                    n.name, n.address, n.external_address
                )
            });
            out.json = json!({"name": n.name, "kind": name_kind(n.kind), "address": n.address,
                              "address_v6": n.address_v6, "external_address": n.external_address});
            Ok(out)
        }
        NameCmd::Delete { name } => {
            c.delete_name(pb::DeleteNameRequest { name: name.clone() })
                .await
                .map_err(status)?;
            Ok(text(format!("unpublished {name}")))
        }
    }
}
