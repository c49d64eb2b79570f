//! Link and TLS: how a dataplane or the CLI reaches the controlplane, the link's shared secret,
//! and the TLS of the controlplane's gRPC port on both ends.

use std::path::{Path, PathBuf};

use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;

use super::decl::{Chart, Default, Flag, Group, Kind, Lit, declare};
use super::parse;
use super::{ClientTls, ConfigError, ServerTls, invalid};

declare! { Group::Link;
    /// where a dataplane or the CLI finds the controlplane (`http://` or `https://`)
    CONTROLPLANE_URL: String => parse::http_url, {
        env: "NM_CONTROLPLANE_URL",
        flag: Some(Flag { long: "controlplane-url", get: |f| f.controlplane_url.as_deref() }),
        file: Some(("controlplane_url", Kind::Str)),
        default: Default::Is(Lit::Str("http://127.0.0.1:50051")),
        chart: Chart::Template,
    };
    /// shared secret every dataplane presents to its controlplane (at least 32 random characters, printable ASCII); required by `dataplane` and by a `controlplane` listening beyond loopback; `serve` needs none
    LINK_SECRET: String => link_secret, {
        env: "NM_LINK_SECRET",
        flag: Some(Flag { long: "link-secret", get: |f| f.link_secret.as_deref() }),
        file: Some(("link_secret", Kind::Str)),
        chart: Chart::Template,
    };
    /// PEM certificate (chain): the controlplane's gRPC port serves TLS (with `NM_GRPC_TLS_KEY`)
    GRPC_TLS_CERT: PathBuf => parse::path, {
        env: "NM_GRPC_TLS_CERT",
        file: Some(("grpc_tls_cert", Kind::Str)),
        chart: Chart::Template,
    };
    /// PEM private key of `NM_GRPC_TLS_CERT`
    GRPC_TLS_KEY: PathBuf => parse::path, {
        env: "NM_GRPC_TLS_KEY",
        file: Some(("grpc_tls_key", Kind::Str)),
        chart: Chart::Template,
    };
    /// PEM CA: the controlplane requires a client certificate it signed (mTLS)
    GRPC_TLS_CLIENT_CA: PathBuf => parse::path, {
        env: "NM_GRPC_TLS_CLIENT_CA",
        file: Some(("grpc_tls_client_ca", Kind::Str)),
        chart: Chart::Template,
    };
    /// PEM CA a dataplane or the CLI trusts for an `https://` `NM_CONTROLPLANE_URL` (default: the public web PKI)
    CONTROLPLANE_CA: PathBuf => parse::path, {
        env: "NM_CONTROLPLANE_CA",
        file: Some(("controlplane_ca", Kind::Str)),
        chart: Chart::Template,
    };
    /// client certificate a dataplane or the CLI presents to the controlplane (mTLS, with `NM_CONTROLPLANE_CLIENT_KEY`)
    CONTROLPLANE_CLIENT_CERT: PathBuf => parse::path, {
        env: "NM_CONTROLPLANE_CLIENT_CERT",
        file: Some(("controlplane_client_cert", Kind::Str)),
        chart: Chart::Template,
    };
    /// private key of `NM_CONTROLPLANE_CLIENT_CERT`
    CONTROLPLANE_CLIENT_KEY: PathBuf => parse::path, {
        env: "NM_CONTROLPLANE_CLIENT_KEY",
        file: Some(("controlplane_client_key", Kind::Str)),
        chart: Chart::Template,
    };
}

/// Shortest accepted link secret or bootstrap key.
pub const MIN_SECRET_LEN: usize = 32;
/// The guesses a secret must need at least, as log10, by [`guesses_log10`]. Measured: random
/// strings of 32 characters (hex, base64, alphanumeric) estimate at 29 to 33; phrases of four
/// to six common words at 19 to 26; repeats, sequences and keyboard walks below 10.
pub const MIN_SECRET_GUESSES_LOG10: f64 = 27.0;

fn link_secret(key: &'static str, raw: super::decl::Raw<'_>) -> Result<String, ConfigError> {
    let secret = parse::text(key, raw)?;
    strong_secret(key, &secret)?;
    if secret.chars().any(|c| !c.is_ascii_graphic()) {
        return Err(invalid(
            key,
            "must be printable ASCII without spaces (it travels in gRPC metadata)",
        ));
    }
    Ok(secret)
}

/// A secret setting of generated strength ([`strong_secret`]).
pub(super) fn secret(key: &'static str, raw: super::decl::Raw<'_>) -> Result<String, ConfigError> {
    let secret = parse::text(key, raw)?;
    strong_secret(key, &secret)?;
    Ok(secret)
}

/// Refuses a secret an attacker could guess: shorter than [`MIN_SECRET_LEN`], or estimated by
/// zxcvbn (dictionary words, names, keyboard walks, repeats, sequences, dates) to fall in fewer
/// than 10^[`MIN_SECRET_GUESSES_LOG10`] guesses.
pub fn strong_secret(key: &str, secret: &str) -> Result<(), ConfigError> {
    let advice = format!(
        "use at least {MIN_SECRET_LEN} random characters, e.g. `nmk_$(openssl rand -hex 24)`"
    );
    if secret.chars().count() < MIN_SECRET_LEN {
        return Err(invalid(key, format!("too short: {advice}")));
    }
    if guesses_log10(secret) < MIN_SECRET_GUESSES_LOG10 {
        return Err(invalid(
            key,
            format!("too easy to guess (words, repeats or sequences): {advice}"),
        ));
    }
    Ok(())
}

/// An estimate of the guesses a secret needs (log10): zxcvbn's (dictionary words, names,
/// keyboard walks, repeats, sequences, dates), summed over the secret's runs of letters, digits
/// and other characters of at most 16 characters each. zxcvbn itself caps its estimate near
/// 10^19, which any string of 20 characters reaches, words or not; on short runs it is exact
/// enough, and the runs of a random string add up far beyond what words do.
pub fn guesses_log10(secret: &str) -> f64 {
    fn class(c: char) -> u8 {
        if c.is_alphabetic() {
            0
        } else if c.is_numeric() {
            1
        } else {
            2
        }
    }
    let mut runs: Vec<String> = Vec::new();
    let mut last = None;
    for c in secret.chars() {
        let full = runs.last().is_some_and(|r| r.chars().count() >= 16);
        if last != Some(class(c)) || full {
            runs.push(String::new());
        }
        if let Some(run) = runs.last_mut() {
            run.push(c);
        }
        last = Some(class(c));
    }
    runs.iter()
        .map(|run| zxcvbn::zxcvbn(run, &[]).guesses_log10())
        .sum()
}

/// Reads a PEM file named by setting `key`.
fn read_pem(key: &str, path: &Path) -> Result<Vec<u8>, ConfigError> {
    std::fs::read(path).map_err(|e| invalid(key, format!("{}: {e}", path.display())))
}

/// The controlplane's TLS settings: certificate and key together, a client CA only with them.
pub(super) fn server_tls(
    cert: Option<PathBuf>,
    key: Option<PathBuf>,
    client_ca: Option<PathBuf>,
) -> Result<Option<ServerTls>, ConfigError> {
    let (cert_env, key_env, ca_env) = (
        GRPC_TLS_CERT.meta.env,
        GRPC_TLS_KEY.meta.env,
        GRPC_TLS_CLIENT_CA.meta.env,
    );
    let (cert, key) = match (cert, key) {
        (None, None) if client_ca.is_some() => {
            return Err(invalid(
                ca_env,
                format!("needs {cert_env} and {key_env} (mTLS is TLS first)"),
            ));
        }
        (None, None) => return Ok(None),
        (Some(_), None) => {
            return Err(invalid(key_env, format!("required with {cert_env}")));
        }
        (None, Some(_)) => {
            return Err(invalid(cert_env, format!("required with {key_env}")));
        }
        (Some(c), Some(k)) => (c, k),
    };
    load_certs_for(cert_env, &cert)?;
    let client_ca_pem = match client_ca {
        Some(path) => {
            load_certs_for(ca_env, &path)?;
            Some(read_pem(ca_env, &path)?)
        }
        None => None,
    };
    let key_pem = read_pem(key_env, &key)?;
    rustls::pki_types::PrivateKeyDer::from_pem_slice(&key_pem)
        .map_err(|e| invalid(key_env, format!("{}: {e}", key.display())))?;
    Ok(Some(ServerTls {
        cert_pem: read_pem(cert_env, &cert)?,
        key_pem,
        client_ca_pem,
    }))
}

/// TLS toward the controlplane; only for an `https://` URL.
pub(super) fn client_tls(
    https: bool,
    ca: Option<PathBuf>,
    cert: Option<PathBuf>,
    key: Option<PathBuf>,
) -> Result<ClientTls, ConfigError> {
    let (ca_env, cert_env, key_env) = (
        CONTROLPLANE_CA.meta.env,
        CONTROLPLANE_CLIENT_CERT.meta.env,
        CONTROLPLANE_CLIENT_KEY.meta.env,
    );
    if !https {
        let set = [(ca_env, &ca), (cert_env, &cert), (key_env, &key)]
            .into_iter()
            .find(|(_, v)| v.is_some());
        if let Some((name, _)) = set {
            return Err(invalid(
                name,
                format!(
                    "set, but {} is not https://: TLS would not be used",
                    CONTROLPLANE_URL.meta.env
                ),
            ));
        }
        return Ok(ClientTls::default());
    }
    let ca_pem = match ca {
        Some(path) => {
            load_certs_for(ca_env, &path)?;
            Some(read_pem(ca_env, &path)?)
        }
        None => None,
    };
    let identity = match (cert, key) {
        (None, None) => None,
        (Some(_), None) => {
            return Err(invalid(key_env, format!("required with {cert_env}")));
        }
        (None, Some(_)) => {
            return Err(invalid(cert_env, format!("required with {key_env}")));
        }
        (Some(c), Some(k)) => {
            load_certs_for(cert_env, &c)?;
            let key_pem = read_pem(key_env, &k)?;
            rustls::pki_types::PrivateKeyDer::from_pem_slice(&key_pem)
                .map_err(|e| invalid(key_env, format!("{}: {e}", k.display())))?;
            Some((read_pem(cert_env, &c)?, key_pem))
        }
    };
    Ok(ClientTls { ca_pem, identity })
}

/// Every certificate in a PEM file named by setting `key`; at least one.
pub(super) fn load_certs_for(
    key: &str,
    path: &Path,
) -> Result<Vec<CertificateDer<'static>>, ConfigError> {
    let bad = |problem: String| invalid(key, format!("{}: {problem}", path.display()));
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| bad(e.to_string()))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| bad(e.to_string()))?;
    if certs.is_empty() {
        return Err(bad("no PEM certificate in the file".to_owned()));
    }
    Ok(certs)
}
