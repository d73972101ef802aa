//! Small netlink helpers the rest of the crate shares: running in another
//! namespace, finding a link, setting it up.

use futures::TryStreamExt;
use rtnetlink::{Handle, LinkUnspec};

use crate::host::R;

pub fn is_exists(e: &rtnetlink::Error) -> bool {
    matches!(e, rtnetlink::Error::NetlinkError(m) if m.raw_code() == -libc::EEXIST)
}

pub fn is_missing(e: &rtnetlink::Error) -> bool {
    matches!(e, rtnetlink::Error::NetlinkError(m) if [-libc::ENOENT, -libc::ESRCH, -libc::ENODEV].contains(&m.raw_code()))
}

pub fn ok_if_missing(r: Result<(), rtnetlink::Error>) -> R<()> {
    match r {
        Err(e) if !is_missing(&e) => Err(e.to_string()),
        _ => Ok(()),
    }
}

/// Runs `f` with a netlink handle inside namespace `ns` on a thread that
/// joined it; the caller awaits the result without blocking its runtime.
pub async fn in_namespace<T: Send + 'static>(
    ns: &str,
    f: impl FnOnce(Handle) -> std::pin::Pin<Box<dyn std::future::Future<Output = R<T>> + Send>> + Send + 'static,
) -> R<T> {
    on_thread_in(format!("/run/netns/{ns}"), move |_| {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| e.to_string())?;
        rt.block_on(async move {
            let (conn, handle, _) = rtnetlink::new_connection().map_err(|e| e.to_string())?;
            tokio::spawn(conn);
            f(handle).await
        })
    })
    .await
}

/// Runs `f` on a thread of its own that joined the network namespace at
/// `path` (given its open file); the caller awaits the result without
/// blocking its runtime.
pub(crate) async fn on_thread_in<T: Send + 'static>(
    path: String,
    f: impl FnOnce(&std::fs::File) -> R<T> + Send + 'static,
) -> R<T> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("weft-netns".into())
        .spawn(move || {
            let run = || -> R<T> {
                let file = std::fs::File::open(&path).map_err(|e| format!("cannot open {path}: {e}"))?;
                nix::sched::setns(&file, nix::sched::CloneFlags::CLONE_NEWNET)
                    .map_err(|e| format!("cannot enter {path}: {e}"))?;
                f(&file)
            };
            let _ = tx.send(run());
        })
        .map_err(|e| format!("cannot start a thread: {e}"))?;
    rx.await.map_err(|_| "the namespace worker panicked".to_string())?
}

/// [`in_namespace`], or `f` with `host` (the agent's own connection) when
/// `ns` is the agent's namespace ("").
pub async fn in_namespace_or_here<T: Send + 'static>(
    host: &Handle,
    ns: &str,
    f: impl FnOnce(Handle) -> std::pin::Pin<Box<dyn std::future::Future<Output = R<T>> + Send>> + Send + 'static,
) -> R<T> {
    if ns.is_empty() {
        f(host.clone()).await
    } else {
        in_namespace(ns, f).await
    }
}

pub async fn index_in(h: &Handle, name: &str) -> R<Option<u32>> {
    let mut links = h.link().get().match_name(name.to_string()).execute();
    match links.try_next().await {
        Ok(Some(l)) => Ok(Some(l.header.index)),
        Ok(None) => Ok(None),
        Err(e) if is_missing(&e) => Ok(None),
        Err(e) => Err(format!("cannot look up link {name}: {e}")),
    }
}

pub async fn need_index_in(h: &Handle, name: &str) -> R<u32> {
    index_in(h, name)
        .await?
        .ok_or_else(|| format!("link {name} does not exist"))
}

/// Sets link `name` up, with `mtu` unless 0.
pub async fn set_up_named(h: &Handle, name: &str, mtu: u32) -> R<()> {
    let idx = need_index_in(h, name).await?;
    no_address_autoconf(h, idx, name).await;
    let mut b = LinkUnspec::new_with_index(idx).up();
    if mtu > 0 {
        b = b.mtu(mtu);
    }
    h.link()
        .set(b.build())
        .execute()
        .await
        .map_err(|e| format!("cannot set {name} up: {e}"))
}

/// Keeps the kernel from giving link `name` an IPv6 link-local address of
/// its own when it goes up: every address on a weft link is weft's (the
/// overlay's IPv6 next hops are link-local addresses the controller
/// renders). Harmless on a link already up; a host without IPv6 refuses
/// it, and then there is nothing to keep away.
async fn no_address_autoconf(h: &Handle, idx: u32, name: &str) {
    use rtnetlink::packet_route::link::{AfSpecInet6, AfSpecUnspec, In6AddrGenMode, LinkAttribute};
    let mut m = LinkUnspec::new_with_index(idx).build();
    m.attributes
        .push(LinkAttribute::AfSpecUnspec(vec![AfSpecUnspec::Inet6(vec![
            AfSpecInet6::AddrGenMode(In6AddrGenMode::None),
        ])]));
    if let Err(e) = h.link().set(m).execute().await {
        tracing::debug!(link = %name, error = %e, "IPv6 address generation left as it is");
    }
}
