//! TLS (rustls) for client and peer traffic, and a development CA.
//!
//! With `--tls-cert/--tls-key/--tls-ca` a node serves only TLS (a plaintext client's
//! handshake fails) and dials its peers over TLS presenting its own certificate. Client
//! certificates are optional on the listener (clients authenticate with bearer tokens),
//! but the peer-only services — Raft, clock sampling, denial reports — and the
//! `allot-forwarded` marker are honoured only from a caller whose certificate chains
//! to the cluster CA (mutual TLS between peers).

use anyhow::Context;
use std::path::{Path, PathBuf};
use tonic::transport::{Certificate, ClientTlsConfig, Identity, ServerTlsConfig};

/// PEM files of a node's TLS set-up.
#[derive(Clone, Debug)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub ca: PathBuf,
}

/// Loaded configuration: what the listener serves and how peers are dialled.
#[derive(Clone, Debug)]
pub struct Tls {
    pub server: ServerTlsConfig,
    pub client: ClientTlsConfig,
}

fn read(p: &Path, what: &str) -> anyhow::Result<Vec<u8>> {
    std::fs::read(p).with_context(|| format!("reading the TLS {what} {}", p.display()))
}

impl Tls {
    pub fn load(f: &TlsFiles) -> anyhow::Result<Tls> {
        let (cert, key, ca) = (
            read(&f.cert, "certificate")?,
            read(&f.key, "key")?,
            read(&f.ca, "CA certificate")?,
        );
        for (bytes, what) in [
            (&cert, "certificate"),
            (&key, "key"),
            (&ca, "CA certificate"),
        ] {
            if !bytes.starts_with(b"-----BEGIN") {
                anyhow::bail!("the TLS {what} is not PEM");
            }
        }
        let identity = Identity::from_pem(&cert, &key);
        let ca = Certificate::from_pem(&ca);
        Ok(Tls {
            server: ServerTlsConfig::new()
                .identity(identity.clone())
                .client_ca_root(ca.clone())
                .client_auth_optional(true),
            client: ClientTlsConfig::new().ca_certificate(ca).identity(identity),
        })
    }
}

/// Writes a development CA and one certificate (server and client use) for `hosts`
/// (IP addresses or DNS names) into `out`: `ca.pem`, `ca-key.pem`, `node.pem`,
/// `node-key.pem`. Keys are written with mode 0600. For local clusters and tests only.
pub fn write_dev_certs(out: &Path, hosts: &[String]) -> anyhow::Result<()> {
    use rcgen::{
        BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    };
    if hosts.is_empty() {
        anyhow::bail!("at least one host (e.g. 127.0.0.1)");
    }
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let ca_key = KeyPair::generate()?;
    let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(DnType::CommonName, "allot development CA");
    let ca = ca_params.self_signed(&ca_key)?;
    let key = KeyPair::generate()?;
    let mut params = CertificateParams::new(hosts.to_vec())?;
    params
        .distinguished_name
        .push(DnType::CommonName, "allot node");
    params.extended_key_usages = vec![
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    let cert = params.signed_by(&key, &ca, &ca_key)?;
    write(out, "ca.pem", &ca.pem(), 0o644)?;
    write(out, "ca-key.pem", &ca_key.serialize_pem(), 0o600)?;
    write(out, "node.pem", &cert.pem(), 0o644)?;
    write(out, "node-key.pem", &key.serialize_pem(), 0o600)?;
    Ok(())
}

fn write(dir: &Path, name: &str, body: &str, mode: u32) -> anyhow::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let p = dir.join(name);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .open(&p)
        .with_context(|| format!("writing {}", p.display()))?;
    f.write_all(body.as_bytes())?;
    Ok(())
}
