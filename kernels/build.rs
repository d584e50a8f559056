//! Compiles `cuda/*.cu` into one fatbin per file with nvcc (sm_90a, sm_100a, sm_120a and
//! compute_90 PTX), embeds them, and writes ptxas resource reports (registers, shared memory,
//! spills) next to them. A register spill or any local memory (stack frame) in any kernel on
//! any architecture fails the build, and so do warpgroup MMAs that ptxas serialized, and a
//! tensor-core kernel whose SASS lacks the
//! tensor-core instruction of its architecture ([`TENSOR_CORE_OPCODES`], read with cuobjdump
//! when it is installed next to nvcc; `scripts/setup --cuda` installs it). Without nvcc the crate builds
//! CPU-only with one warning; `PDSERVE_REQUIRE_CUDA_KERNELS=1` turns that into an error (CI).

#[path = "build/constants.rs"]
mod constants;
#[path = "build/signatures.rs"]
mod signatures;

use std::{
    env,
    fmt::Write as _,
    path::{Path, PathBuf},
    process::{Command, ExitCode},
};

const GENCODES: &[&str] = &[
    "-gencode=arch=compute_90a,code=sm_90a",
    "-gencode=arch=compute_100a,code=sm_100a",
    "-gencode=arch=compute_120a,code=sm_120a",
    "-gencode=arch=compute_90,code=compute_90",
];

/// Tensor-core kernels: (file, architecture, an opcode its SASS must contain there). An FP8 or
/// FP4 MMA that compiled to conversions plus FP16 MMAs would otherwise pass unnoticed.
const TENSOR_CORE_OPCODES: &[(&str, &str, &str)] = &[
    // Block-scaled FP4 mma.sync (kind::mxf4nvf4, scale_vec::4X).
    (
        "nvfp4_gemm_sm120",
        "sm_120a",
        "OMMA.SF.16864.F32.E2M1.E2M1.UE4M3.4X",
    ),
    // tcgen05.mma block-scaled FP4 from Tensor Memory.
    ("nvfp4_gemm_sm100", "sm_100a", "UTCOMMA.4X"),
    // FP4 dequantized to bf16: the warpgroup MMA on sm_90a (`*_wgmma`, what an sm_90 device
    // runs), WMMA everywhere.
    ("nvfp4_gemm", "sm_90a", "HGMMA.64x64x16.F32.BF16"),
    ("nvfp4_gemm", "sm_90a", "HMMA.16816.F32.BF16"),
    ("nvfp4_gemm", "sm_100a", "HMMA.16816.F32.BF16"),
    ("nvfp4_gemm", "sm_120a", "HMMA.16816.F32.BF16"),
    // Dense bf16 / FP8-block weights dequantized to bf16: the warpgroup MMA on sm_90a
    // (`dense_gemm_*_wgmma`, what an sm_90 device runs), WMMA everywhere.
    ("dense_gemm", "sm_90a", "HGMMA.64x64x16.F32.BF16"),
    ("dense_gemm", "sm_90a", "HMMA.16816.F32.BF16"),
    ("dense_gemm", "sm_100a", "HMMA.16816.F32.BF16"),
    ("dense_gemm", "sm_120a", "HMMA.16816.F32.BF16"),
    // The indexer's tensor-core scores: a request's heads as the M side of bf16 mma.sync.
    ("indexer", "sm_90a", "HMMA.16816.F32.BF16"),
    ("indexer", "sm_100a", "HMMA.16816.F32.BF16"),
    ("indexer", "sm_120a", "HMMA.16816.F32.BF16"),
    // Decode attention with the heads as the M side of bf16 mma.sync (not wgmma yet).
    ("attn_decode_fp8", "sm_90a", "HMMA.16816.F32.BF16"),
    ("attn_decode_fp8", "sm_100a", "HMMA.16816.F32.BF16"),
    ("attn_decode_fp8", "sm_120a", "HMMA.16816.F32.BF16"),
];

fn main() -> ExitCode {
    match build() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            #[expect(clippy::print_stderr, reason = "build script error output")]
            {
                eprintln!("kernels build failed: {e}");
            }
            ExitCode::FAILURE
        }
    }
}

/// nvcc from `PDSERVE_CUDA_HOME`, the setup cache (`scripts/setup --cuda`), `CUDA_HOME`, or PATH.
fn find_nvcc() -> Option<PathBuf> {
    let var = |name: &str| {
        env::var_os(name)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    let cache = var("PDSERVE_CACHE_DIR")
        .or_else(|| var("XDG_CACHE_HOME").map(|d| d.join("pdserve")))
        .or_else(|| var("HOME").map(|h| h.join(".cache/pdserve")));
    let candidates = [
        var("PDSERVE_CUDA_HOME").map(|h| h.join("bin/nvcc")),
        cache.map(|c| c.join("cuda/home/bin/nvcc")),
        var("CUDA_HOME").map(|h| h.join("bin/nvcc")),
    ];
    candidates
        .into_iter()
        .flatten()
        .find(|p| p.is_file())
        .or_else(|| {
            Command::new("nvcc")
                .arg("--version")
                .output()
                .ok()
                .filter(|o| o.status.success())
                .map(|_| PathBuf::from("nvcc"))
        })
}

fn build() -> Result<(), String> {
    for var in [
        "PDSERVE_CUDA_HOME",
        "PDSERVE_CACHE_DIR",
        "CUDA_HOME",
        "PDSERVE_REQUIRE_CUDA_KERNELS",
    ] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    println!("cargo:rustc-check-cfg=cfg(kernels_compiled)");
    let out = PathBuf::from(env::var("OUT_DIR").map_err(|e| e.to_string())?);
    let mut sources: Vec<PathBuf> = std::fs::read_dir("cuda")
        .map_err(|e| format!("cuda/: {e}"))?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .collect();
    sources.sort();
    // The folder too, so an added kernel file triggers a rebuild.
    println!("cargo:rerun-if-changed=cuda");
    for path in &sources {
        println!("cargo:rerun-if-changed={}", path.display());
    }
    let kernels: Vec<&PathBuf> = sources
        .iter()
        .filter(|p| p.extension().is_some_and(|x| x == "cu"))
        .collect();
    let mut parsed = Vec::new();
    for k in &kernels {
        let name = k.file_stem().and_then(|s| s.to_str()).unwrap_or("kernel");
        let source = std::fs::read_to_string(k).map_err(|e| format!("{}: {e}", k.display()))?;
        let found = signatures::kernels(&source).map_err(|e| format!("{}: {e}", k.display()))?;
        parsed.push((name.to_owned(), found));
    }
    std::fs::write(out.join("kernel_params.rs"), signatures::launchers(&parsed))
        .map_err(|e| e.to_string())?;
    let mut values = Vec::new();
    for path in &sources {
        let name = path
            .file_name()
            .and_then(|s| s.to_str())
            .unwrap_or("kernel");
        if path.extension().is_some_and(|x| x == "cu" || x == "cuh") {
            let source =
                std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
            values.push((name.to_owned(), constants::constants(&source)));
        }
    }
    std::fs::write(out.join("kernel_constants.rs"), constants::modules(&values))
        .map_err(|e| e.to_string())?;
    let mut generated = String::from("// Generated by build.rs: embedded fatbins.\n");
    let require = env::var("PDSERVE_REQUIRE_CUDA_KERNELS").is_ok_and(|v| v == "1");
    let Some(nvcc) = find_nvcc() else {
        if require {
            return Err(
                "nvcc not found and PDSERVE_REQUIRE_CUDA_KERNELS=1 (run scripts/setup --cuda)"
                    .into(),
            );
        }
        println!(
            "cargo:warning=nvcc not found: building kernels without CUDA (scripts/setup --cuda installs nvcc)"
        );
        for k in &kernels {
            let _ = writeln!(generated, "pub const {}: &[u8] = &[];", const_name(k));
        }
        std::fs::write(out.join("fatbins.rs"), generated).map_err(|e| e.to_string())?;
        return Ok(());
    };
    for k in &kernels {
        let name = k.file_stem().and_then(|s| s.to_str()).unwrap_or("kernel");
        let fatbin = out.join(format!("{name}.fatbin"));
        let report = compile(&nvcc, k, &fatbin)?;
        std::fs::write(out.join(format!("{name}.ptxas.txt")), &report)
            .map_err(|e| e.to_string())?;
        if let Some(line) = report.lines().find(|l| {
            l.contains("spill") && !l.contains(" 0 bytes spill stores, 0 bytes spill loads")
        }) {
            return Err(format!("{}: register spills: {line}", k.display()));
        }
        if let Some(line) = report
            .lines()
            .find(|l| l.contains("bytes stack frame") && !l.trim_start().starts_with("0 bytes"))
        {
            return Err(format!("{}: local memory: {line}", k.display()));
        }
        // ptxas waits after each warpgroup MMA when it cannot keep the accumulators apart from
        // the code between issue and wait: correct, but the MMAs no longer overlap the loads.
        if let Some(line) = report.lines().find(|l| l.contains("wgmma.mma_async")) {
            return Err(format!(
                "{}: warpgroup MMAs serialized: {line}",
                k.display()
            ));
        }
        check_sass(&nvcc, name, &fatbin, require)?;
        if let Some((_, found)) = parsed.iter().find(|(n, _)| n == name) {
            check_params(&nvcc, name, &fatbin, found, require)?;
        }
        let _ = writeln!(
            generated,
            "pub const {}: &[u8] = include_bytes!(concat!(env!(\"OUT_DIR\"), \"/{name}.fatbin\"));",
            const_name(k)
        );
    }
    std::fs::write(out.join("fatbins.rs"), generated).map_err(|e| e.to_string())?;
    println!("cargo:rustc-cfg=kernels_compiled");
    Ok(())
}

fn const_name(path: &Path) -> String {
    path.file_stem()
        .and_then(|s| s.to_str())
        .unwrap_or("kernel")
        .to_ascii_uppercase()
}

/// Checks that `fatbin` (kernel file `name`) has its tensor-core opcodes
/// ([`TENSOR_CORE_OPCODES`]). Without cuobjdump next to nvcc: a warning, or an error when
/// kernels are required.
fn check_sass(nvcc: &Path, name: &str, fatbin: &Path, require: bool) -> Result<(), String> {
    let expected: Vec<_> = TENSOR_CORE_OPCODES
        .iter()
        .filter(|(file, ..)| *file == name)
        .collect();
    if expected.is_empty() {
        return Ok(());
    }
    let bin = nvcc.parent().unwrap_or(Path::new(""));
    let cuobjdump = bin.join("cuobjdump");
    if !cuobjdump.is_file() {
        let why = format!(
            "no cuobjdump next to {}: SASS of {name} not checked",
            nvcc.display()
        );
        if require {
            return Err(format!("{why} (run scripts/setup --cuda)"));
        }
        println!("cargo:warning={why}");
        return Ok(());
    }
    for (_, arch, opcode) in expected {
        let output = Command::new(&cuobjdump)
            .args(["-sass", "-arch", arch])
            .arg(fatbin)
            .env("NVDISASM_PATH", bin)
            .output()
            .map_err(|e| format!("cannot run {}: {e}", cuobjdump.display()))?;
        let sass = String::from_utf8_lossy(&output.stdout);
        if !output.status.success() {
            return Err(format!(
                "cuobjdump -sass -arch {arch} {name}: {}",
                String::from_utf8_lossy(&output.stderr)
            ));
        }
        if !sass.contains(opcode) {
            return Err(format!(
                "{name} on {arch}: its SASS has no {opcode} (the tensor-core instruction it is \
                 written for)"
            ));
        }
    }
    Ok(())
}

/// Checks the parameter lists read from `name`'s source ([`signatures::kernels`]) against
/// the `.entry` parameters of its compiled PTX: every kernel there, with as many parameters
/// of the same widths, and no entry the reader missed.
fn check_params(
    nvcc: &Path,
    name: &str,
    fatbin: &Path,
    found: &[signatures::Kernel],
    require: bool,
) -> Result<(), String> {
    let bin = nvcc.parent().unwrap_or(Path::new(""));
    let cuobjdump = bin.join("cuobjdump");
    if !cuobjdump.is_file() {
        let why = format!(
            "no cuobjdump next to {}: parameters of {name} not checked",
            nvcc.display()
        );
        if require {
            return Err(format!("{why} (run scripts/setup --cuda)"));
        }
        println!("cargo:warning={why}");
        return Ok(());
    }
    let output = Command::new(&cuobjdump)
        .args(["-ptx"])
        .arg(fatbin)
        .output()
        .map_err(|e| format!("cannot run {}: {e}", cuobjdump.display()))?;
    if !output.status.success() {
        return Err(format!(
            "cuobjdump -ptx {name}: {}",
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    let entries = signatures::ptx_entries(&String::from_utf8_lossy(&output.stdout));
    for (entry, widths) in &entries {
        let Some(k) = found.iter().find(|k| k.name == *entry) else {
            return Err(format!(
                "{name}: kernel {entry} is in the PTX but not read from the source"
            ));
        };
        let read: Vec<usize> = k.params.iter().map(|(_, p)| p.bytes()).collect();
        if read != *widths {
            return Err(format!(
                "{name}: kernel {entry} takes parameters of {widths:?} bytes in the PTX, \
                 {read:?} as read from the source"
            ));
        }
    }
    if let Some(k) = found
        .iter()
        .find(|k| !entries.iter().any(|(e, _)| *e == k.name))
    {
        return Err(format!(
            "{name}: kernel {} read from the source is not in the PTX",
            k.name
        ));
    }
    Ok(())
}

/// Runs nvcc; returns the ptxas resource report.
fn compile(nvcc: &Path, source: &Path, fatbin: &Path) -> Result<String, String> {
    let output = Command::new(nvcc)
        .arg("-fatbin")
        .args(GENCODES)
        .args(["-O3", "-std=c++17", "-Xptxas", "-v", "-o"])
        .arg(fatbin)
        .arg(source)
        .output()
        .map_err(|e| format!("cannot run {}: {e}", nvcc.display()))?;
    let report = String::from_utf8_lossy(&output.stderr).into_owned();
    if !output.status.success() {
        return Err(format!("nvcc failed on {}:\n{report}", source.display()));
    }
    Ok(report)
}
