//! Certificates for the link's TLS tests, made fresh in each test: a CA, a controlplane
//! certificate for `localhost` and 127.0.0.1, and a dataplane client certificate, written as
//! PEM files into a directory (the settings take paths).

use std::path::{Path, PathBuf};

/// Paths of the PEM files.
#[derive(Debug, Clone)]
pub struct Pki {
    pub ca: PathBuf,
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
}

fn issuer() -> rcgen::CertifiedIssuer<'static, rcgen::KeyPair> {
    let key = rcgen::KeyPair::generate().unwrap_or_else(|e| panic!("{e}"));
    let mut params =
        rcgen::CertificateParams::new(Vec::<String>::new()).unwrap_or_else(|e| panic!("{e}"));
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, "nm-gateway test CA");
    rcgen::CertifiedIssuer::self_signed(params, key).unwrap_or_else(|e| panic!("{e}"))
}

fn leaf(
    ca: &rcgen::CertifiedIssuer<'static, rcgen::KeyPair>,
    names: &[&str],
    usage: rcgen::ExtendedKeyUsagePurpose,
) -> (String, String) {
    let key = rcgen::KeyPair::generate().unwrap_or_else(|e| panic!("{e}"));
    let mut params =
        rcgen::CertificateParams::new(names.iter().map(|n| (*n).to_owned()).collect::<Vec<_>>())
            .unwrap_or_else(|e| panic!("{e}"));
    params.extended_key_usages = vec![usage];
    let cert = params.signed_by(&key, ca).unwrap_or_else(|e| panic!("{e}"));
    (cert.pem(), key.serialize_pem())
}

impl Pki {
    /// A fresh CA and its two certificates, in `dir`.
    pub fn create(dir: &Path) -> Self {
        Self::create_named(dir, "pki")
    }

    /// Like [`Pki::create`], with file names starting with `prefix` (several PKIs in one
    /// directory).
    pub fn create_named(dir: &Path, prefix: &str) -> Self {
        let ca = issuer();
        let (server_cert, server_key) = leaf(
            &ca,
            &["localhost", "127.0.0.1"],
            rcgen::ExtendedKeyUsagePurpose::ServerAuth,
        );
        let (client_cert, client_key) = leaf(
            &ca,
            &["dataplane"],
            rcgen::ExtendedKeyUsagePurpose::ClientAuth,
        );
        let write = |name: &str, pem: &str| {
            let path = dir.join(format!("{prefix}-{name}.pem"));
            std::fs::write(&path, pem).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            path
        };
        Self {
            ca: write("ca", &ca.pem()),
            server_cert: write("server", &server_cert),
            server_key: write("server-key", &server_key),
            client_cert: write("client", &client_cert),
            client_key: write("client-key", &client_key),
        }
    }

    /// The controlplane's settings: TLS, and with `mtls` client certificates required.
    pub fn server_env(&self, mtls: bool) -> Vec<(&'static str, String)> {
        let mut env = vec![
            ("NM_GRPC_TLS_CERT", self.server_cert.display().to_string()),
            ("NM_GRPC_TLS_KEY", self.server_key.display().to_string()),
        ];
        if mtls {
            env.push(("NM_GRPC_TLS_CLIENT_CA", self.ca.display().to_string()));
        }
        env
    }

    /// A dataplane's (or the CLI's) settings: trust the CA, present the client certificate.
    pub fn client_env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("NM_CONTROLPLANE_CA", self.ca.display().to_string()),
            (
                "NM_CONTROLPLANE_CLIENT_CERT",
                self.client_cert.display().to_string(),
            ),
            (
                "NM_CONTROLPLANE_CLIENT_KEY",
                self.client_key.display().to_string(),
            ),
        ]
    }
}
