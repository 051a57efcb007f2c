//! Who may log in to the console: users from a file (`PIPELINE_CONSOLE_USERS_FILE`) and/or the
//! environment (`PIPELINE_CONSOLE_USERS`), never from the repository. One user a line,
//! `name:role:hash`:
//! - `role` is `viewer` (reads every page, acts on nothing) or `operator` (may act);
//! - `hash` is an Argon2 PHC string (`$argon2id$v=19$…`, from `pipeline console
//!   --hash-password`), or `sha256:` and 64 hex digits for a long random token (a fast hash
//!   is enough for a secret that cannot be guessed; a password a person chose needs Argon2).

use std::collections::BTreeMap;
use std::path::Path;
use std::str::FromStr;

use anyhow::{bail, Context};
use argon2::password_hash::{rand_core::OsRng, PasswordHash, PasswordHasher, SaltString};
use argon2::{Algorithm, Argon2, Block, Params, Version};
use sha2::{Digest, Sha256};

/// What a user may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Sees everything, changes nothing.
    Viewer,
    /// May act: replay, skip, discard, requeue, publish now, cancel, reprocess, pause, resume.
    Operator,
}

impl Role {
    /// `viewer` or `operator`.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Viewer => "viewer",
            Role::Operator => "operator",
        }
    }
}

/// How a user's secret is checked.
enum Verifier {
    /// An Argon2 PHC string.
    Argon2(String),
    /// The SHA-256 of a token.
    Sha256([u8; 32]),
}

struct Entry {
    role: Role,
    verifier: Verifier,
}

/// The users who may log in.
#[derive(Default)]
pub struct Users {
    entries: BTreeMap<String, Entry>,
}

impl std::fmt::Debug for Users {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Names and roles only: hashes stay out of every log.
        f.debug_map()
            .entries(self.entries.iter().map(|(n, e)| (n, e.role)))
            .finish()
    }
}

impl Users {
    /// The users of the file at `file` and of `env` (the file's first; a name given twice is an
    /// error). At least one user is needed: a console nobody can log in to serves nothing.
    pub fn load(file: Option<&Path>, env: Option<&str>) -> anyhow::Result<Users> {
        let mut users = Users::default();
        if let Some(path) = file {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading the users file {}", path.display()))?;
            users.add_lines(text.lines(), &path.display().to_string())?;
        }
        if let Some(env) = env {
            users.add_lines(env.split_whitespace(), "PIPELINE_CONSOLE_USERS")?;
        }
        if users.entries.is_empty() {
            bail!(
                "no console user: give PIPELINE_CONSOLE_USERS_FILE (--users-file) or \
                 PIPELINE_CONSOLE_USERS (--users), lines of name:role:hash"
            );
        }
        Ok(users)
    }

    /// Users from `text` (lines of `name:role:hash`), for tests and embedding programs.
    pub fn parse(text: &str) -> anyhow::Result<Users> {
        let mut users = Users::default();
        users.add_lines(text.lines(), "users")?;
        Ok(users)
    }

    fn add_lines<'a>(
        &mut self,
        lines: impl Iterator<Item = &'a str>,
        source: &str,
    ) -> anyhow::Result<()> {
        for (n, line) in lines.enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            // The message names the line, never its hash.
            let at = format!("{source}, entry {}", n + 1);
            let mut parts = line.splitn(3, ':');
            let (Some(name), Some(role), Some(hash)) = (parts.next(), parts.next(), parts.next())
            else {
                bail!("{at}: not name:role:hash");
            };
            if !possible_name(name) {
                bail!("{at}: a user name is 1 to 64 printable characters without spaces");
            }
            let role = match role {
                "viewer" => Role::Viewer,
                "operator" => Role::Operator,
                _ => bail!("{at}: the role of {name} is neither viewer nor operator"),
            };
            let verifier = if let Some(hex) = hash.strip_prefix("sha256:") {
                Verifier::Sha256(
                    parse_hex(hex).with_context(|| format!("{at}: sha256: needs 64 hex digits"))?,
                )
            } else {
                let _ = PasswordHash::new(hash).map_err(|e| {
                    anyhow::anyhow!("{at}: not an Argon2 PHC string nor sha256:HEX ({e})")
                })?;
                if !hash.starts_with("$argon2") {
                    bail!("{at}: only Argon2 PHC strings are accepted");
                }
                Verifier::Argon2(hash.to_owned())
            };
            if self
                .entries
                .insert(name.to_owned(), Entry { role, verifier })
                .is_some()
            {
                bail!("{at}: user {name} is given twice");
            }
        }
        Ok(())
    }

    /// How many users there are.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether there is none.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Whether some user is called `name`.
    pub fn has(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }

    /// The role of `name` when `password` is theirs. CPU-bound (Argon2): call it off the
    /// async workers. A name no user has, and a token user's name, cost the same Argon2 check
    /// (against a hash of nothing anyone knows), so the time of a refusal does not tell which
    /// names exist.
    pub fn verify(&self, name: &str, password: &str) -> Option<Role> {
        self.verify_in(name, password, &mut Vec::new())
    }

    /// [`Users::verify`] with the Argon2 check's memory (about 19 MiB) taken from `memory`,
    /// grown to the size the check needs and kept for the next one: a thread that checks
    /// passwords one after another holds that memory once, where an allocation for each check
    /// left the allocator holding several.
    pub fn verify_in(&self, name: &str, password: &str, memory: &mut Vec<Block>) -> Option<Role> {
        let Some(entry) = self.entries.get(name) else {
            check_against_nothing(password, memory);
            return None;
        };
        let ok = match &entry.verifier {
            Verifier::Argon2(phc) => argon2_matches(phc, password, memory),
            Verifier::Sha256(want) => {
                // A token is checked in microseconds: the Argon2 check of a name no user has is
                // done as well, so that the time of a refusal does not tell token users apart.
                check_against_nothing(password, memory);
                let got: [u8; 32] = Sha256::digest(password.as_bytes()).into();
                constant_time_eq(&got, want)
            }
        };
        ok.then_some(entry.role)
    }
}

/// Whether `password` hashes to the Argon2 PHC string `phc` (its algorithm, version, parameters
/// and salt), computed in `memory`.
fn argon2_matches(phc: &str, password: &str, memory: &mut Vec<Block>) -> bool {
    let Ok(hash) = PasswordHash::new(phc) else {
        return false;
    };
    let (Some(salt), Some(want)) = (hash.salt, hash.hash) else {
        return false;
    };
    let Ok(algorithm) = Algorithm::try_from(hash.algorithm) else {
        return false;
    };
    let version = match hash.version.map(Version::try_from) {
        None => Version::default(),
        Some(Ok(version)) => version,
        Some(Err(_)) => return false,
    };
    let Ok(params) = Params::try_from(&hash) else {
        return false;
    };
    let mut salt_bytes = [0u8; 64];
    let Ok(salt) = salt.decode_b64(&mut salt_bytes) else {
        return false;
    };
    if memory.len() < params.block_count() {
        memory.resize(params.block_count(), Block::default());
    }
    let blocks = params.block_count();
    let mut got = vec![0u8; want.len()];
    Argon2::new(algorithm, version, params)
        .hash_password_into_with_memory(password.as_bytes(), salt, &mut got, &mut memory[..blocks])
        .is_ok()
        && constant_time_eq(&got, want.as_bytes())
}

/// Whether a user could be called `name`: 1 to 64 printable ASCII characters without spaces,
/// as the users file requires. A login with any other name is refused before it is logged or
/// tracked.
pub(super) fn possible_name(name: &str) -> bool {
    (1..=64).contains(&name.len()) && name.chars().all(|c| c.is_ascii_graphic())
}

/// The Argon2 check of a password against [`unknown_user_hash`], whose outcome is not used: the
/// same work as a user's check.
fn check_against_nothing(password: &str, memory: &mut Vec<Block>) {
    let _ = argon2_matches(unknown_user_hash(), password, memory);
}

/// The hash an unknown user name's password is checked against: Argon2 with the default
/// parameters (those of [`hash_password`]) of a random secret, made once.
fn unknown_user_hash() -> &'static str {
    static HASH: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    HASH.get_or_init(|| {
        let mut secret = [0u8; 32];
        rand::RngCore::fill_bytes(&mut rand::rng(), &mut secret);
        let secret: String = secret.iter().map(|b| format!("{b:02x}")).collect();
        hash_password(&secret).unwrap_or_default()
    })
}

/// The Argon2id PHC string of `password`, with a random salt, for the users file.
pub fn hash_password(password: &str) -> anyhow::Result<String> {
    if password.is_empty() {
        bail!("an empty password");
    }
    let salt = SaltString::generate(&mut OsRng);
    Argon2::default()
        .hash_password(password.as_bytes(), &salt)
        .map(|h| h.to_string())
        .map_err(|e| anyhow::anyhow!("hashing the password: {e}"))
}

/// Whether `a` and `b` are equal, in a time that depends on their length only.
pub(crate) fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn parse_hex(hex: &str) -> anyhow::Result<[u8; 32]> {
    if hex.len() != 64 {
        bail!("{} digits", hex.len());
    }
    let mut out = [0u8; 32];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16)?;
    }
    Ok(out)
}

/// A value that must not be printed: `Debug` shows `<redacted>`.
#[derive(Clone)]
pub struct Secret(String);

impl Secret {
    /// The value itself.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<redacted>")
    }
}

impl FromStr for Secret {
    type Err = std::convert::Infallible;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(Secret(s.to_owned()))
    }
}
