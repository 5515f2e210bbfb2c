use super::dev::DevPki;
use super::*;

fn file(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

fn server(cert: &Path, key: &Path) -> TlsConfig {
    TlsConfig { cert: Some(cert.into()), key: Some(key.into()), ..TlsConfig::default() }
}

#[test]
fn a_generated_set_loads_on_both_sides() {
    let pki = DevPki::temp(dev::LOOPBACK_NAMES).unwrap();
    let tls = pki.node().load().unwrap();
    assert!(tls.enabled());
    assert!(tls.server.as_ref().unwrap().requires_client_cert());
    // The node identity doubles as the client identity.
    assert!(tls.client.as_ref().unwrap().has_identity());
    let c = pki.client().load().unwrap();
    assert!(c.server.is_none() && c.client.unwrap().has_identity());
    assert!(!TlsConfig::default().load().unwrap().enabled());
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        for key in [&pki.key, &pki.client_key] {
            assert_eq!(std::fs::metadata(key).unwrap().permissions().mode() & 0o777, 0o600, "{}", key.display());
        }
        assert_eq!(std::fs::metadata(&pki.dir).unwrap().permissions().mode() & 0o777, 0o700);
    }
    let dir = pki.dir.clone();
    drop(pki);
    assert!(!dir.exists(), "the throwaway folder is removed");
}

#[test]
fn pem_errors_name_the_option_and_the_file() {
    let pki = DevPki::temp(dev::LOOPBACK_NAMES).unwrap();
    let d = &pki.dir;
    let missing = d.join("nope.pem");
    let err = server(&missing, &pki.key).load().unwrap_err();
    assert!(matches!(err, TlsError::Read { flag: "--tls-cert", .. }), "{err:?}");
    let msg = err.to_string();
    assert!(msg.contains("--tls-cert") && msg.contains("nope.pem") && msg.contains("cannot read"), "{msg}");

    // A key given as the certificate: the message says so.
    let err = server(&pki.key, &pki.key).load().unwrap_err();
    assert!(matches!(err, TlsError::NoCertificate { has_key: true, .. }), "{err:?}");
    assert!(err.to_string().contains("is it the key file?"), "{err}");

    // Not PEM at all.
    let text = file(d, "text.pem", "hello\n");
    let err = server(&text, &pki.key).load().unwrap_err();
    assert!(matches!(err, TlsError::NoCertificate { has_key: false, .. }), "{err:?}");
    assert!(err.to_string().contains("text.pem"), "{err}");

    // A corrupt block (bad base64).
    let corrupt = file(d, "corrupt.pem", "-----BEGIN CERTIFICATE-----\nMIIB!!!not base64@@\n-----END CERTIFICATE-----\n");
    let err = server(&corrupt, &pki.key).load().unwrap_err();
    assert!(matches!(err, TlsError::BadPem { flag: "--tls-cert", .. }), "{err:?}");
    assert!(err.to_string().contains("corrupt.pem") && err.to_string().contains("corrupt PEM"), "{err}");
    // A truncated one (no END line).
    let truncated = file(d, "truncated.pem", &std::fs::read_to_string(&pki.cert).unwrap()[..200]);
    let err = server(&truncated, &pki.key).load().unwrap_err();
    assert!(matches!(err, TlsError::BadPem { .. }), "{err:?}");

    // A certificate given as the key.
    let err = server(&pki.cert, &pki.cert).load().unwrap_err();
    assert!(matches!(err, TlsError::NoKey { flag: "--tls-key", .. }), "{err:?}");
    assert!(err.to_string().contains("node.pem"), "{err}");

    // A key that does not match its certificate: rustls refuses it at load, naming both files.
    let err = server(&pki.cert, &pki.client_key).load().unwrap_err();
    assert!(matches!(err, TlsError::Rejected { .. }), "{err:?}");
    assert!(err.to_string().contains("node.pem") && err.to_string().contains("client.key"), "{err}");

    // The client side names its own options.
    let err = TlsConfig { ca: Some(text.clone()), ..TlsConfig::default() }.load().unwrap_err();
    assert!(matches!(err, TlsError::NoCertificate { flag: "--tls-ca", .. }), "{err:?}");
    let err = TlsConfig { client_key: Some(pki.cert.clone()), ..pki.client() }.load().unwrap_err();
    assert!(matches!(err, TlsError::NoKey { flag: "--tls-client-key", .. }), "{err:?}");
    let err = TlsConfig { client_ca: Some(missing.clone()), ..pki.node() }.load().unwrap_err();
    assert!(matches!(err, TlsError::Read { flag: "--tls-client-ca", .. }), "{err:?}");
}

#[test]
fn options_that_need_another_are_refused() {
    let p = PathBuf::from("/x.pem");
    let cases = [
        (TlsConfig { cert: Some(p.clone()), ..TlsConfig::default() }, "--tls-cert needs --tls-key"),
        (TlsConfig { key: Some(p.clone()), ..TlsConfig::default() }, "--tls-key needs --tls-cert"),
        (TlsConfig { client_ca: Some(p.clone()), ..TlsConfig::default() }, "--tls-client-ca needs"),
        (TlsConfig { client_cert: Some(p.clone()), client_key: Some(p.clone()), ..TlsConfig::default() }, "need --tls-ca"),
        (TlsConfig { server_name: Some("a".into()), ..TlsConfig::default() }, "--tls-server-name needs --tls-ca"),
        (TlsConfig { ca: Some(p.clone()), client_cert: Some(p.clone()), ..TlsConfig::default() }, "--tls-client-cert needs --tls-client-key"),
    ];
    for (cfg, want) in cases {
        let err = cfg.load().unwrap_err();
        assert!(err.to_string().contains(want), "{cfg:?}: {err}");
    }
}

#[test]
fn uris_follow_tls() {
    let pki = DevPki::temp(dev::LOOPBACK_NAMES).unwrap();
    let tls = pki.client().client().unwrap().unwrap();
    let t = Some(&tls);
    assert_eq!(uri("127.0.0.1:7700", None).unwrap(), "http://127.0.0.1:7700");
    assert_eq!(uri("http://r:7700", None).unwrap(), "http://r:7700");
    assert_eq!(uri("127.0.0.1:7700", t).unwrap(), "https://127.0.0.1:7700");
    // Never downgraded, never plaintext when TLS is on.
    assert_eq!(uri("http://r:7700", t).unwrap(), "https://r:7700");
    assert_eq!(uri("HTTPS://r:7700", t).unwrap(), "https://r:7700");
    assert!(matches!(uri("https://r:7700", None), Err(TlsError::HttpsWithoutTls { .. })));
    assert!(matches!(uri("ftp://r:7700", t), Err(TlsError::BadAddress { .. })));
    assert!(endpoint("127.0.0.1:1", t).is_ok() && endpoint("127.0.0.1:1", None).is_ok());
    assert!(matches!(endpoint("bad host:1", None), Err(TlsError::BadAddress { .. })));
}
