//! TLS (rustls) for client and peer traffic, and a development CA.
//!
//! With `--tls-cert/--tls-key/--tls-ca` a node serves only TLS (a plaintext client's
//! handshake fails) and dials its peers over TLS presenting its own certificate. Client
//! certificates are optional on the listener (clients authenticate with bearer tokens),
//! but the peer-only services — Raft, clock sampling, denial reports — and the
//! `allot-forwarded` marker are honoured only from a caller whose certificate chains
//! to the cluster CA (mutual TLS between peers).
//!
//! The listener is allot's own (rustls, as tonic's is) rather than tonic's, so that a
//! connection's protocol is known after the handshake: a peer that negotiates
//! [`ALPN_LINK`] gets the peer link (`crate::link`), anything else (`h2`, or no ALPN)
//! the gRPC server. The peer link is dialled over TLS with the node's certificate, so
//! the peer link carries Raft between TLS nodes as it does between plaintext ones
//! (DESIGN §65).

use anyhow::Context;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tonic::transport::{Certificate, ClientTlsConfig, Identity};

/// ALPN of HTTP/2 (gRPC), as tonic's own listener offers it.
pub const ALPN_H2: &[u8] = b"h2";
/// ALPN of the peer link inside TLS. A listener that does not offer it (a release
/// before it, or `--peer-link off`) fails the dialler's handshake with
/// `no_application_protocol`, and the dialler uses gRPC for that peer.
pub const ALPN_LINK: &[u8] = b"allot-link/1";

/// PEM files of a node's TLS set-up.
#[derive(Clone, Debug)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub ca: PathBuf,
}

/// Loaded configuration: what the listener serves and how peers are dialled.
#[derive(Clone)]
pub struct Tls {
    /// The listener: the node's certificate; a client certificate is optional and, when
    /// presented, must chain to the cluster CA. ALPN `h2`, and [`ALPN_LINK`] when the
    /// node serves the peer link.
    pub server: Arc<rustls::ServerConfig>,
    /// gRPC calls to peers (forwarding, clock samples, Raft without the link).
    pub client: ClientTlsConfig,
    /// The peer link's dialler: trusts the cluster CA, presents the node's certificate,
    /// offers only [`ALPN_LINK`].
    pub link: Arc<rustls::ClientConfig>,
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tls")
            .field("alpn", &self.server.alpn_protocols)
            .finish_non_exhaustive()
    }
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn certs(pem: &[u8], what: &str) -> anyhow::Result<Vec<CertificateDer<'static>>> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .with_context(|| format!("the TLS {what} is not a PEM certificate"))?;
    if certs.is_empty() {
        anyhow::bail!("the TLS {what} holds no certificate");
    }
    Ok(certs)
}

fn roots(ca_pem: &[u8]) -> anyhow::Result<rustls::RootCertStore> {
    let mut roots = rustls::RootCertStore::empty();
    for c in certs(ca_pem, "CA certificate")? {
        roots
            .add(c)
            .context("the TLS CA certificate is not a usable trust anchor")?;
    }
    Ok(roots)
}

/// The listener's configuration (see [`Tls::server`]).
pub fn server_config(
    cert_pem: &[u8],
    key_pem: &[u8],
    ca_pem: &[u8],
    serve_link: bool,
) -> anyhow::Result<Arc<rustls::ServerConfig>> {
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
        Arc::new(roots(ca_pem)?),
        provider(),
    )
    .allow_unauthenticated()
    .build()
    .context("the TLS client verifier")?;
    let key = PrivateKeyDer::from_pem_slice(key_pem).context("the TLS key is not a PEM key")?;
    let mut config = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_client_cert_verifier(verifier)
        .with_single_cert(certs(cert_pem, "certificate")?, key)
        .context("the TLS certificate and key")?;
    config.alpn_protocols = vec![ALPN_H2.to_vec()];
    if serve_link {
        config.alpn_protocols.push(ALPN_LINK.to_vec());
    }
    Ok(Arc::new(config))
}

/// The peer link's dialler configuration: trusts `ca_pem`, presents `identity` (a
/// certificate and key, PEM) when given, offers only [`ALPN_LINK`].
pub fn link_client_config(
    ca_pem: &[u8],
    identity: Option<(&[u8], &[u8])>,
) -> anyhow::Result<Arc<rustls::ClientConfig>> {
    let builder = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots(ca_pem)?);
    let mut config = match identity {
        Some((cert, key)) => builder
            .with_client_auth_cert(
                certs(cert, "certificate")?,
                PrivateKeyDer::from_pem_slice(key).context("the TLS key is not a PEM key")?,
            )
            .context("the TLS certificate and key")?,
        None => builder.with_no_client_auth(),
    };
    config.alpn_protocols = vec![ALPN_LINK.to_vec()];
    Ok(Arc::new(config))
}

/// The name a dialled `host:port` is verified against (an IP address or a DNS name),
/// as the gRPC channel verifies the host of its `https://` URI.
pub fn server_name(dial: &str) -> anyhow::Result<ServerName<'static>> {
    let host = match dial.rsplit_once(':') {
        Some((h, port)) if port.parse::<u16>().is_ok() => h,
        _ => dial,
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    ServerName::try_from(host.to_string())
        .with_context(|| format!("{dial}: not a host name or IP address"))
}

fn read(p: &Path, what: &str) -> anyhow::Result<Vec<u8>> {
    std::fs::read(p).with_context(|| format!("reading the TLS {what} {}", p.display()))
}

impl Tls {
    /// Reads and checks the PEM files; `serve_link`: the listener offers the peer link.
    pub fn load(f: &TlsFiles, serve_link: bool) -> anyhow::Result<Tls> {
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
        let server = server_config(&cert, &key, &ca, serve_link)?;
        let link = link_client_config(&ca, Some((&cert, &key)))?;
        let identity = Identity::from_pem(&cert, &key);
        Ok(Tls {
            server,
            client: ClientTlsConfig::new()
                .ca_certificate(Certificate::from_pem(&ca))
                .identity(identity),
            link,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dialled_address_names_the_host_it_is_verified_against() {
        let name = |d: &str| server_name(d).map(|n| n.to_str().into_owned());
        assert_eq!(name("127.0.0.1:7001").unwrap(), "127.0.0.1");
        assert_eq!(name("[::1]:7001").unwrap(), "::1");
        assert_eq!(
            name("node-2.allot.internal:7001").unwrap(),
            "node-2.allot.internal"
        );
        assert_eq!(name("localhost").unwrap(), "localhost");
        assert!(name("bad host:7001").is_err());
        assert!(name(":7001").is_err());
    }

    #[test]
    fn the_listener_offers_the_link_only_when_it_serves_it() {
        let dir = tempfile::tempdir().unwrap();
        write_dev_certs(dir.path(), &["127.0.0.1".into()]).unwrap();
        let files = TlsFiles {
            cert: dir.path().join("node.pem"),
            key: dir.path().join("node-key.pem"),
            ca: dir.path().join("ca.pem"),
        };
        let on = Tls::load(&files, true).unwrap();
        assert_eq!(on.server.alpn_protocols, [ALPN_H2, ALPN_LINK]);
        assert_eq!(on.link.alpn_protocols, [ALPN_LINK]);
        let off = Tls::load(&files, false).unwrap();
        assert_eq!(off.server.alpn_protocols, [ALPN_H2]);
        // A key where the certificate should be is refused with a reason.
        let swapped = TlsFiles {
            cert: files.key.clone(),
            ..files
        };
        let e = Tls::load(&swapped, true).unwrap_err();
        assert!(format!("{e:#}").contains("certificate"), "{e:#}");
    }
}
