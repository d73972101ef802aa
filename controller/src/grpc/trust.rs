//! The admin calls about the site's trust: the admin bundle's rotation and
//! the site CA's status during a rotation.

use tonic::{Request, Response, Status};
use weft_proto::v1 as pb;

use super::AdminApi;

impl AdminApi {
    /// `RotateAdminCert`: a new admin bundle, the old certificate revoked
    /// on every replica; only over the local admin socket.
    pub(super) async fn admin_cert_rotated(
        &self,
        req: Request<pb::RotateAdminCertRequest>,
    ) -> Result<Response<pb::RotateAdminCertResponse>, Status> {
        if !matches!(self.auth.caller(&req)?, Some(crate::auth::Caller::Local)) {
            return Err(Status::permission_denied(
                "rotate the admin bundle on the controller's host, over its admin socket \
                 (weft-controller admin-cert rotate)",
            ));
        }
        let Some((dir, site)) = self.pki.clone() else {
            return Err(Status::failed_precondition("this controller has no pki directory"));
        };
        let (serial, old) = tokio::task::spawn_blocking({
            let dir = dir.clone();
            move || crate::pki::rotate_admin(&dir, &site)
        })
        .await
        .map_err(|e| Status::internal(format!("the rotation task failed: {e}")))?
        .map_err(|e| Status::internal(format!("cannot write the new admin bundle: {e:#}")))?;
        if let Some((old_serial, not_after_ms)) = &old {
            self.state.revoke_admin(old_serial, *not_after_ms).await?;
            self.auth.revoke(old_serial.clone(), crate::auth::RevokedAs::Other);
            tracing::info!(revoked = %old_serial, "revoked the previous admin certificate");
        }
        Ok(Response::new(pb::RotateAdminCertResponse {
            cert_path: dir.join(crate::pki::ADMIN_CERT).display().to_string(),
            key_path: dir.join(crate::pki::ADMIN_KEY).display().to_string(),
            serial,
            revoked_serial: old.map(|o| o.0).unwrap_or_default(),
        }))
    }

    /// `GetCaStatus`: what still holds on to an older site CA, with each
    /// connected agent's release.
    pub(super) async fn ca_status(&self) -> Result<Response<pb::CaStatus>, Status> {
        let model = self.hub.model();
        let versions = self
            .state
            .alive()
            .await?
            .into_iter()
            .map(|((role, name), rec)| (format!("{}/{name}", role.as_str()), rec.version))
            .collect();
        Ok(Response::new(crate::ca::status(
            &self.cas,
            &model,
            &versions,
            crate::domain::now_ms(),
        )))
    }
}
