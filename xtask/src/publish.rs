//! The checks of `cargo xtask ci` that keep the crates publishable: every publishable crate
//! packs (`cargo package`), the declared `rust-version` is at least what every dependency
//! declares (`msrv`), and the dependency graph's licenses and duplicates pass `cargo deny`.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::Path;

use anyhow::{bail, Context as _};
use serde_json::Value;

/// The checks `cargo xtask ci` runs on the publishable crates, in this order (cheapest
/// first); `cargo xtask publish-check` runs them alone. Returns the first failing step's
/// exit code, or 0.
pub(crate) fn run(root: &Path, steps: &[Step]) -> anyhow::Result<i32> {
    // Read once, by the first step that needs it (msrv and package both do).
    let mut metadata: Option<Value> = None;
    for step in [Step::Msrv, Step::Deny, Step::Package] {
        if !steps.is_empty() && !steps.contains(&step) {
            continue;
        }
        let code = match step {
            Step::Msrv | Step::Package => {
                let metadata = match &mut metadata {
                    Some(m) => m,
                    None => match read_metadata(root)? {
                        Ok(m) => metadata.insert(m),
                        Err(code) => return Ok(code),
                    },
                };
                if step == Step::Msrv {
                    msrv(metadata)?
                } else {
                    package(root, metadata)?
                }
            }
            Step::Deny => deny(root)?,
        };
        if code != 0 {
            return Ok(code);
        }
    }
    Ok(0)
}

/// `cargo metadata --format-version 1 --locked` under a header: the workspace members
/// and the resolved graph of `Cargo.lock` for every target platform. `Ok(Err(code))` is
/// cargo's exit code when it failed (its stderr printed).
fn read_metadata(root: &Path) -> anyhow::Result<Result<Value, i32>> {
    let title = "cargo metadata --format-version 1 --locked";
    crate::header(title);
    let output = crate::cargo()
        .current_dir(root)
        .args(["metadata", "--format-version", "1", "--locked"])
        .output()
        .with_context(|| format!("running {title}"))?;
    if !output.status.success() {
        eprintln!("{}", String::from_utf8_lossy(&output.stderr));
        eprintln!("xtask ci: `{title}` failed ({})", output.status);
        return Ok(Err(output.status.code().unwrap_or(1)));
    }
    let metadata =
        serde_json::from_slice(&output.stdout).context("parsing cargo metadata's output")?;
    Ok(Ok(metadata))
}

/// One check of [`run`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Step {
    /// Every dependency's rust-version against the declared one.
    Msrv,
    /// `cargo deny check licenses bans`.
    Deny,
    /// `cargo package --locked` on every publishable crate.
    Package,
}

/// `cargo deny check licenses bans` against `deny.toml`, installing cargo-deny first
/// (`cargo install --locked cargo-deny`, a few minutes) when it is missing, as on a fresh
/// CI machine.
///
/// Not `advisories`: that check needs the RustSec advisory database, fetched from GitHub
/// at run time, which the machines this runs on cannot reach. Nothing here pretends to
/// check advisories; run `cargo deny check advisories` where the network allows.
fn deny(root: &Path) -> anyhow::Result<i32> {
    let installed = crate::cargo()
        .current_dir(root)
        .args(["deny", "--version"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|status| status.success());
    if !installed {
        let title = "cargo install --locked cargo-deny";
        crate::header(title);
        let status = crate::cargo()
            .current_dir(root)
            .args(["install", "--locked", "cargo-deny"])
            .status()
            .with_context(|| format!("running {title}"))?;
        if !status.success() {
            eprintln!("xtask ci: `{title}` failed ({status})");
            return Ok(status.code().unwrap_or(1));
        }
    }
    cargo_step(
        root,
        "cargo deny --locked check --hide-inclusion-graph licenses bans",
        // The duplicate warnings name the versions; the graph of each is long, see it
        // with `cargo deny check bans`.
        &[
            "deny",
            "--locked",
            "check",
            "--hide-inclusion-graph",
            "licenses",
            "bans",
        ],
    )
}

/// `cargo package --locked -p ...` on every publishable member (`cargo package
/// --workspace` would pack the `publish = false` ones too): each packs (its manifest, its
/// README and license files, path dependencies that carry a version), and each packed crate
/// builds on its own from the packed sources (the verify step, through a local registry of
/// the other packed members).
fn package(root: &Path, metadata: &Value) -> anyhow::Result<i32> {
    // `packages` lists the dependencies too: only the workspace's own members are packed.
    let members: BTreeSet<&str> = metadata["workspace_members"]
        .as_array()
        .context("cargo metadata: no `workspace_members`")?
        .iter()
        .filter_map(Value::as_str)
        .collect();
    let mut args = vec!["package".to_owned(), "--locked".to_owned()];
    let mut packed = Vec::new();
    for package in metadata["packages"].as_array().into_iter().flatten() {
        let member = package["id"]
            .as_str()
            .is_some_and(|id| members.contains(id));
        if member && is_publishable(package) {
            let name = package["name"]
                .as_str()
                .context("a package without a name")?;
            let version = package["version"].as_str().unwrap_or_default();
            packed.push(format!("{name}-{version}"));
            args.extend(["-p".to_owned(), name.to_owned()]);
        }
    }
    forget_stale_unpacked(&packed);
    let title = format!("cargo {}", args.join(" "));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    cargo_step(root, &title, &args)
}

/// Removes what an earlier `cargo package` left unpacked of `crates` (`name-version`) in
/// cargo's registry sources.
///
/// The verify step builds each packed crate against the others through a local registry
/// under `target/package`, and cargo unpacks those into `$CARGO_HOME/registry/src/<hash of
/// the registry's path>/`, keeping what is there: a second run from the same checkout path
/// built against the first run's sources of the same version (seen: dlock-etcd verified
/// against a dlock-core from before a new enum variant). Only local registries' folders
/// are touched (crates.io's is named `index.crates.io-...`), and in them only these crates.
fn forget_stale_unpacked(crates: &[String]) {
    let home = std::env::var_os("CARGO_HOME")
        .map(std::path::PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".cargo")));
    let Some(src) = home.map(|h| h.join("registry").join("src")) else {
        return;
    };
    let Ok(registries) = std::fs::read_dir(&src) else {
        return;
    };
    for registry in registries.flatten() {
        // Local registries have no host in their folder's name: `-<hash>`.
        if !registry.file_name().to_string_lossy().starts_with('-') {
            continue;
        }
        for krate in crates {
            let stale = registry.path().join(krate);
            if stale.is_dir() {
                if let Err(e) = std::fs::remove_dir_all(&stale) {
                    eprintln!("xtask: could not remove {}: {e}", stale.display());
                }
            }
        }
    }
}

/// Whether a package of `cargo metadata` may be published: `publish = false` is an empty
/// list of registries; absent (null) means crates.io.
fn is_publishable(package: &Value) -> bool {
    !package["publish"]
        .as_array()
        .is_some_and(|registries| registries.is_empty())
}

/// Runs `cargo ARGS` in the workspace under a header; its exit code.
fn cargo_step(root: &Path, title: &str, args: &[&str]) -> anyhow::Result<i32> {
    crate::header(title);
    let status = crate::cargo()
        .current_dir(root)
        .args(args)
        .status()
        .with_context(|| format!("running {title}"))?;
    if status.success() {
        Ok(0)
    } else {
        eprintln!("xtask ci: `{title}` failed ({status})");
        Ok(status.code().unwrap_or(1))
    }
}

/// A `rust-version` as cargo writes it: `1.80`, `1.85.0`; missing parts are 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct RustVersion([u64; 3]);

impl RustVersion {
    fn parse(text: &str) -> anyhow::Result<Self> {
        let mut parts = [0; 3];
        let mut count = 0;
        for (slot, part) in parts.iter_mut().zip(text.split('.')) {
            *slot = part
                .parse()
                .with_context(|| format!("rust-version {text:?}: {part:?} is not a number"))?;
            count += 1;
        }
        if count == 0 || text.split('.').count() > 3 {
            bail!("rust-version {text:?}: expected MAJOR.MINOR[.PATCH]");
        }
        Ok(Self(parts))
    }
}

impl fmt::Display for RustVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let [major, minor, patch] = self.0;
        if patch == 0 {
            write!(f, "{major}.{minor}")
        } else {
            write!(f, "{major}.{minor}.{patch}")
        }
    }
}

/// One package of the resolved graph that declares a `rust-version`.
#[derive(Debug)]
struct Declared {
    name: String,
    version: String,
    rust_version: RustVersion,
}

/// `cargo xtask ci`'s MSRV check, without a second toolchain: every package reachable
/// through normal and build dependencies from a publishable workspace crate (one without
/// `publish = false`) must declare a `rust-version` no newer than that crate's. Reads the
/// resolved graph of `Cargo.lock` from [`read_metadata`], for every target platform (so a
/// dependency used only on Windows or macOS counts too). Dev-dependencies do not count:
/// they build only the crate's own tests. What this cannot see, the crates' own code using
/// a newer std API, clippy's `incompatible_msrv` lint catches (it reads the same
/// `rust-version`). Returns the process exit code: 0 when every dependency fits.
fn msrv(metadata: &Value) -> anyhow::Result<i32> {
    let MsrvReport {
        roots,
        offenders,
        highest,
        reached,
    } = msrv_offenders(metadata)?;
    for (root, declared) in &roots {
        eprintln!("msrv: {root} declares rust-version {declared}");
    }
    if let Some(dep) = &highest {
        eprintln!(
            "msrv: {reached} packages reached through normal and build dependencies; the highest \
             rust-version among them is {} ({} {})",
            dep.rust_version, dep.name, dep.version
        );
    }
    if offenders.is_empty() {
        eprintln!("msrv: ok, no dependency needs a newer Rust than its dependent crate declares");
        return Ok(0);
    }
    for (root, deps) in &offenders {
        let declared = roots.get(root).copied();
        for dep in deps {
            eprintln!(
                "msrv: {root} (rust-version {}) depends on {} {} which declares rust-version {}",
                declared.map_or_else(|| "none".to_owned(), |v| v.to_string()),
                dep.name,
                dep.version,
                dep.rust_version
            );
        }
    }
    if let Some(dep) = highest {
        eprintln!(
            "xtask ci: the declared rust-version is too low: raise `rust-version` in the \
             workspace Cargo.toml to {} (and the docs that name it), or pin the offending \
             dependencies to older versions in Cargo.lock",
            dep.rust_version
        );
    }
    Ok(1)
}

/// What the MSRV check found.
#[derive(Debug)]
struct MsrvReport {
    /// Each publishable crate and the rust-version it declares.
    roots: BTreeMap<String, RustVersion>,
    /// Per publishable crate, the dependencies that declare a newer rust-version, newest first.
    offenders: BTreeMap<String, Vec<Declared>>,
    /// The reached dependency with the highest rust-version.
    highest: Option<Declared>,
    /// How many packages the walk reached (the roots excluded).
    reached: usize,
}

fn msrv_offenders(metadata: &Value) -> anyhow::Result<MsrvReport> {
    let packages = metadata["packages"]
        .as_array()
        .context("cargo metadata: no `packages`")?;
    let by_id: BTreeMap<&str, &Value> = packages
        .iter()
        .filter_map(|p| Some((p["id"].as_str()?, p)))
        .collect();
    let nodes: BTreeMap<&str, &Value> = metadata["resolve"]["nodes"]
        .as_array()
        .context("cargo metadata: no `resolve.nodes` (was it run with --no-deps?)")?
        .iter()
        .filter_map(|n| Some((n["id"].as_str()?, n)))
        .collect();
    let members = metadata["workspace_members"]
        .as_array()
        .context("cargo metadata: no `workspace_members`")?;

    let mut roots = BTreeMap::new();
    let mut offenders: BTreeMap<String, Vec<Declared>> = BTreeMap::new();
    let mut highest: Option<Declared> = None;
    let mut reached_all = BTreeSet::new();
    for member in members.iter().filter_map(Value::as_str) {
        let package = by_id
            .get(member)
            .with_context(|| format!("cargo metadata: no package {member}"))?;
        if !is_publishable(package) {
            continue;
        }
        let name = package["name"].as_str().unwrap_or(member).to_owned();
        let declared = match package["rust_version"].as_str() {
            Some(text) => RustVersion::parse(text)?,
            None => bail!("{name} is publishable but declares no rust-version"),
        };
        roots.insert(name.clone(), declared);

        // Every package reachable through normal or build edges, the root excluded.
        let mut seen = BTreeSet::new();
        let mut stack = vec![member];
        while let Some(id) = stack.pop() {
            if !seen.insert(id) {
                continue;
            }
            let node = nodes
                .get(id)
                .with_context(|| format!("cargo metadata: no resolve node for {id}"))?;
            for dep in node["deps"].as_array().into_iter().flatten() {
                // `kind` is null for a normal dependency.
                let runtime = dep["dep_kinds"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|k| matches!(k["kind"].as_str(), None | Some("build")));
                if let (true, Some(pkg)) = (runtime, dep["pkg"].as_str()) {
                    stack.push(pkg);
                }
            }
        }
        seen.remove(member);
        for id in seen {
            reached_all.insert(id);
            let package = by_id
                .get(id)
                .with_context(|| format!("cargo metadata: no package {id}"))?;
            let Some(text) = package["rust_version"].as_str() else {
                continue;
            };
            let dep = Declared {
                name: package["name"].as_str().unwrap_or(id).to_owned(),
                version: package["version"].as_str().unwrap_or("?").to_owned(),
                rust_version: RustVersion::parse(text).with_context(|| format!("package {id}"))?,
            };
            // The highest one reported is outside the workspace: a member reached as a
            // dependency is checked above but says nothing new (it declares the same).
            let external = !members.iter().any(|m| m.as_str() == Some(id));
            if external
                && highest
                    .as_ref()
                    .is_none_or(|h| dep.rust_version > h.rust_version)
            {
                highest = Some(Declared {
                    name: dep.name.clone(),
                    version: dep.version.clone(),
                    rust_version: dep.rust_version,
                });
            }
            if dep.rust_version > declared {
                offenders.entry(name.clone()).or_default().push(dep);
            }
        }
    }
    if roots.is_empty() {
        bail!("no publishable workspace member found");
    }
    for deps in offenders.values_mut() {
        deps.sort_by(|a, b| {
            (b.rust_version, &a.name, &a.version).cmp(&(a.rust_version, &b.name, &b.version))
        });
    }
    Ok(MsrvReport {
        roots,
        offenders,
        highest,
        reached: reached_all.len(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rust_versions_compare_by_number() {
        let v = |s| RustVersion::parse(s).expect("valid");
        assert!(v("1.80") < v("1.85.0"));
        assert!(v("1.9") < v("1.10"));
        assert_eq!(v("1.85"), v("1.85.0"));
        assert!(v("1.85.1") > v("1.85"));
        assert_eq!(v("1.89.0").to_string(), "1.89");
        assert!(RustVersion::parse("1.x").is_err());
        assert!(RustVersion::parse("1.2.3.4").is_err());
    }

    #[test]
    fn offenders_are_found_through_normal_and_build_edges_only() {
        let metadata = serde_json::json!({
            "workspace_members": ["app", "tool"],
            "packages": [
                {"id": "app", "name": "app", "version": "0.1.0", "rust_version": "1.80", "publish": null},
                {"id": "tool", "name": "tool", "version": "0.1.0", "rust_version": "1.80", "publish": []},
                {"id": "new", "name": "new", "version": "2.0.0", "rust_version": "1.89", "publish": null},
                {"id": "old", "name": "old", "version": "1.0.0", "rust_version": "1.70", "publish": null},
                {"id": "bld", "name": "bld", "version": "1.0.0", "rust_version": "1.82.0", "publish": null},
                {"id": "dev", "name": "dev", "version": "1.0.0", "rust_version": "1.95", "publish": null},
            ],
            "resolve": {"nodes": [
                {"id": "app", "deps": [
                    {"pkg": "old", "dep_kinds": [{"kind": null}]},
                    {"pkg": "bld", "dep_kinds": [{"kind": "build"}]},
                    {"pkg": "dev", "dep_kinds": [{"kind": "dev"}]},
                ]},
                {"id": "tool", "deps": [{"pkg": "dev", "dep_kinds": [{"kind": null}]}]},
                {"id": "old", "deps": [{"pkg": "new", "dep_kinds": [{"kind": null}]}]},
                {"id": "new", "deps": []},
                {"id": "bld", "deps": []},
                {"id": "dev", "deps": []},
            ]},
        });
        let MsrvReport {
            roots,
            offenders,
            highest,
            reached,
        } = msrv_offenders(&metadata).expect("well-formed metadata");
        assert_eq!(roots.keys().collect::<Vec<_>>(), ["app"]);
        let names: Vec<_> = offenders["app"].iter().map(|d| d.name.as_str()).collect();
        assert_eq!(names, ["new", "bld"]);
        assert_eq!(highest.map(|h| h.name), Some("new".to_owned()));
        assert_eq!(reached, 3);
    }
}
