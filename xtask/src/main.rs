//! `cargo xtask`: dlock's developer tasks (see matklad/cargo-xtask).

fn main() -> anyhow::Result<()> {
    anyhow::bail!("no tasks yet")
}
