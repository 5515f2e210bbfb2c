//! Generates the gRPC code for proto/ferry/v1 into OUT_DIR with the vendored protoc, plus the file
//! descriptor set that server reflection serves.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?).join("../../proto");
    let files = ["common", "client", "worker", "admin"].map(|f| root.join(format!("ferry/v1/{f}.proto")));
    for f in &files {
        println!("cargo:rerun-if-changed={}", f.display());
    }
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    // SAFETY-free: build scripts are single-threaded; prost-build reads PROTOC from the environment.
    unsafe { std::env::set_var("PROTOC", protoc_bin_vendored::protoc_bin_path()?) };
    tonic_prost_build::configure()
        .bytes(".")
        .file_descriptor_set_path(out.join("ferry_descriptor.bin"))
        .compile_protos(&files, &[root])?;
    Ok(())
}
