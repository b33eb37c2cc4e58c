//! The command line: `coli [--model ENGINE] [-p TEXT | -f PATH] [-n N] [-q | -v]
//! [KEY=VALUE ...] [CAP [EBITS [DBITS]]]` and the subcommands. This module parses and
//! dispatches, turning the flags that stand for a setting into that setting; it holds no
//! model logic.

use std::ffi::OsString;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};

use crate::settings::{self, Settings};
use crate::startup::{self, Positionals};
use crate::verbosity::{self, Level};

/// What `--help` ends with: the main job's modes and the subcommands on the committed trained
/// fixture, each a command that runs as written from the repository's root.
const EXAMPLES: &str = "\
Examples (from the repository's root):
  coli SNAP=fixtures/olmoe_trained PROMPT=\"The licence grants you\" NGEN=40 TEMP=0
      text after a prompt, greedy; the text alone on stdout
  coli SNAP=fixtures/olmoe_trained -p \"The licence grants you\" -n 40 TEMP=0 -q
      the same with flags, and no start-up or statistics lines on stderr
  echo \"The licence grants you\" | coli SNAP=fixtures/olmoe_trained -f -
      the prompt from standard input (or -f FILE), sampled at TEMP=0.7
  coli chat SNAP=fixtures/olmoe_trained
      a conversation in the terminal, through the model's chat template
  coli serve SNAP=fixtures/olmoe_trained --port 8080
      OpenAI and Anthropic APIs over HTTP (docs/serve.md)
  coli SNAP=fixtures/olmoe_trained ORACLE_STRICT=1 64 16 16
      without a prompt or ids: the oracle check against SNAP/ref.json, exact f32
  coli SNAP=fixtures/olmoe_trained TF=1 ORACLE_STRICT=1 1 16 16
      the same teacher-forced, one expert slot per layer
  coli settings
      every KEY with its type, default and description";

#[derive(Parser, Debug)]
#[command(
    name = "coli",
    version,
    about = "Run mixture-of-experts models over memory-mapped expert shards",
    args_conflicts_with_subcommands = true,
    after_help = EXAMPLES
)]
pub struct Cli {
    /// Engine to run; defaults to model_type in SNAP/config.json.
    #[arg(long, value_name = "ENGINE", value_parser = engine_names())]
    pub model: Option<String>,

    /// Generate text after TEXT (the same as PROMPT=TEXT).
    #[arg(short, long, value_name = "TEXT")]
    pub prompt: Option<String>,

    /// Generate text after the prompt in this file (`-` reads standard input); one final
    /// newline is not part of the prompt.
    #[arg(short, long, value_name = "PATH", conflicts_with = "prompt")]
    pub file: Option<PathBuf>,

    /// Tokens to generate (the same as NGEN=N).
    #[arg(short = 'n', value_name = "N")]
    pub ngen: Option<u64>,

    /// Print only what the run produces (a prompt's text on stdout) and its errors and
    /// warnings: no start-up or statistics lines on stderr.
    #[arg(short, long, conflicts_with = "verbose")]
    pub quiet: bool,

    /// Also print the settings given and where each came from, and the prompt's token ids.
    #[arg(short, long)]
    pub verbose: bool,

    /// KEY=VALUE settings, then up to three numbers: CAP (expert slots per MoE layer,
    /// 0 = auto), EBITS (bits for float experts, >=16 = f32), DBITS (dense, default EBITS).
    #[arg(
        value_name = "KEY=VALUE | CAP [EBITS [DBITS]]",
        allow_negative_numbers = true
    )]
    pub args: Vec<String>,

    #[command(subcommand)]
    pub command: Option<Command>,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Print every setting with its type, default and description.
    Settings,
    /// Convert a Hugging Face checkpoint (f32/bf16/f16, or FP8 with block scales) into a
    /// quantised container that every engine reads: int8 per row or int4 per group, norms,
    /// routers, biases and what the engine reads only in f32 kept f32. Resumable: rerun the
    /// same command after an interruption.
    Convert(ConvertArgs),
    /// Inspect, merge and migrate `.coli_usage` expert-usage histories (no model loaded).
    #[command(subcommand)]
    Usage(crate::tools::UsageCommand),
    /// Measure a ROUTE_TRACE stream, replay it through expert-cache policies, and draw
    /// heat maps (no model loaded).
    #[command(subcommand)]
    Trace(crate::tools::TraceCommand),
    /// Serve the model over HTTP with OpenAI's API (chat and text completions, streamed or
    /// not), /health and Prometheus /metrics; several generations batched a step, prompts
    /// starting from the kept conversation state sharing their longest prefix, the history
    /// saved after every turn. Settings as for a run (SNAP=..., CAP EBITS DBITS).
    Serve(ServeArgs),
    /// Chat with the model in the terminal: multi-turn, through its chat template, the KV
    /// cache reused across turns and the history saved after each. Settings as for a run.
    Chat(ChatArgs),
}

#[derive(clap::Args, Debug)]
pub struct ChatArgs {
    /// The system prompt the conversation starts with (`/system` changes it).
    #[arg(long, value_name = "TEXT")]
    pub system: Option<String>,
    /// KEY=VALUE settings, then up to three numbers: CAP EBITS DBITS, as for a run.
    #[arg(value_name = "KEY=VALUE | CAP [EBITS [DBITS]]")]
    pub args: Vec<String>,
}

#[derive(clap::Args, Debug)]
pub struct ServeArgs {
    /// Address to listen on; beyond loopback it needs API_KEY=<token>.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0 = any free port, printed at start).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Generations running at once, batched into one forward a step.
    #[arg(long, default_value_t = 4, value_name = "N")]
    pub parallel: usize,
    /// The most prompt tokens one step feeds: a long prompt holds the running generations up
    /// by one chunk at a time.
    #[arg(long, default_value_t = crate::serve::DEFAULT_PREFILL_CHUNK, value_name = "TOKENS")]
    pub prefill_chunk: usize,
    /// Requests that may wait for a free generation; beyond them the answer is 429 with
    /// Retry-After.
    #[arg(long, default_value_t = 64, value_name = "N")]
    pub queue: usize,
    /// MB of conversation states kept for prefix reuse (least recently used go first);
    /// default: half of what the expert store leaves for the rest of the run.
    #[arg(long, value_name = "MB")]
    pub cache_mb: Option<f64>,
    /// Directory where kept conversation states are written when evicted and at shutdown,
    /// and read back when a prompt shares their prefix (after a restart too); files of
    /// another model, engine, config or width are refused by name and left alone.
    #[arg(long, value_name = "DIR")]
    pub kv_dir: Option<std::path::PathBuf>,
    /// MB the --kv-dir files of this model may take (least recently used go first).
    #[arg(long, default_value_t = 4000.0, value_name = "MB")]
    pub kv_dir_mb: f64,
    /// A web page origin (`https://chat.example`) whose scripts may call the server (CORS);
    /// repeat it for more, `*` for any. Without it a request from another origin's page is
    /// refused (403).
    #[arg(long, value_name = "ORIGIN")]
    pub cors_origin: Vec<String>,
    /// A host name requests may give in `Host` besides the address listened on (and
    /// `localhost` on loopback), e.g. behind a proxy; repeat it for more, `*` for any.
    #[arg(long, value_name = "NAME")]
    pub allowed_host: Vec<String>,
    /// Seconds a request's head (request line and headers) may take to arrive; a connection
    /// waiting longer, a kept-alive one between requests included, is closed.
    #[arg(long, default_value_t = 10.0, value_name = "SECONDS")]
    pub header_timeout: f64,
    /// Seconds a request body may go without a byte arriving (then 408).
    #[arg(long, default_value_t = 30.0, value_name = "SECONDS")]
    pub body_timeout: f64,
    /// Connections open at once; one more is answered 503 with Retry-After and closed.
    #[arg(long, default_value_t = 256, value_name = "N")]
    pub max_connections: usize,
    /// Only server errors in the per-request log (one line per request by default).
    #[arg(short, long, conflicts_with = "verbose")]
    pub quiet: bool,
    /// Also log each request's arrival.
    #[arg(short, long)]
    pub verbose: bool,
    /// KEY=VALUE settings, then up to three numbers: CAP EBITS DBITS, as for a run.
    #[arg(value_name = "KEY=VALUE | CAP [EBITS [DBITS]]")]
    pub args: Vec<String>,
}

#[derive(clap::Args, Debug)]
pub struct ConvertArgs {
    /// Checkpoint directory: config.json, *.safetensors, tokenizer files.
    pub src: std::path::PathBuf,
    /// Output directory (new, empty, or an interrupted conversion of the same source).
    pub dst: std::path::PathBuf,
    /// Bits for every class not given below: >=16 keeps float, 5..8 int8 per row, 4 int4;
    /// or a format: fp8 (E4M3, 128x128 block scales), mxfp4 (OCP MX FP4).
    #[arg(long, default_value = "8")]
    pub bits: crate::convert::Precision,
    /// Bits or format for routed experts (default: --bits).
    #[arg(long)]
    pub expert_bits: Option<crate::convert::Precision>,
    /// Bits or format for other matrices: attention, shared experts, dense MLPs (default:
    /// --bits).
    #[arg(long)]
    pub dense_bits: Option<crate::convert::Precision>,
    /// Bits or format for the embedding and LM head (default: --dense-bits, but at least 8
    /// bits; fp8 stays fp8).
    #[arg(long)]
    pub io_bits: Option<crate::convert::Precision>,
    /// Columns per int4 scale: 16, 32, 48, 64, 96, 128, 192 or 256; 0 = one per row.
    #[arg(long, default_value_t = crate::quant::DEFAULT_INT4_GROUP)]
    pub group_size: usize,
    /// Largest output shard in GB.
    #[arg(long, default_value_t = 4.0)]
    pub shard_gb: f64,
    /// The engine whose f32 tensors stay f32; defaults to model_type in SRC/config.json.
    #[arg(long, value_name = "ENGINE", value_parser = engine_names())]
    pub model: Option<String>,
}

/// `--model`'s values: the engines this build runs, so that clap lists them in `--help`
/// and refuses a typo with them.
fn engine_names() -> clap::builder::PossibleValuesParser {
    clap::builder::PossibleValuesParser::new(crate::engines::ENGINES)
}

/// Parse `argv` and run; errors are reported by the caller with exit code 2.
pub fn run(argv: impl IntoIterator<Item = OsString>) -> Result<ExitCode> {
    let cli = match Cli::try_parse_from(argv) {
        Ok(cli) => cli,
        Err(err) => {
            // clap prints help/version to stdout (exit 0) and usage errors to stderr (exit 2).
            let code = if err.use_stderr() { 2 } else { 0 };
            let _ = err.print();
            return Ok(ExitCode::from(code));
        }
    };
    match &cli.command {
        Some(Command::Convert(args)) => convert(args),
        Some(Command::Usage(cmd)) => {
            crate::tools::run_usage(cmd)?;
            Ok(ExitCode::SUCCESS)
        }
        Some(Command::Trace(cmd)) => {
            crate::tools::run_trace(cmd)?;
            Ok(ExitCode::SUCCESS)
        }
        Some(Command::Serve(args)) => {
            refuse_mpirun("coli serve")?;
            let (settings, positionals) = resolve(&args.args)?;
            let cache_bytes = match args.cache_mb {
                Some(mb) if !(mb >= 0.0 && mb.is_finite()) => {
                    bail!("--cache-mb {mb}: expected a number of megabytes, 0 or more")
                }
                Some(mb) => Some((mb * 1e6) as u64),
                None => None,
            };
            if !(args.kv_dir_mb >= 0.0 && args.kv_dir_mb.is_finite()) {
                bail!(
                    "--kv-dir-mb {}: expected a number of megabytes, 0 or more",
                    args.kv_dir_mb
                );
            }
            let serving = crate::serve::Serving {
                parallel: args.parallel,
                prefill_chunk: args.prefill_chunk,
                cache_bytes,
                kv_dir: args
                    .kv_dir
                    .clone()
                    .map(|dir| (dir, (args.kv_dir_mb * 1e6) as u64)),
                front: crate::serve::Front::Server,
            };
            // At most a day: the deadlines are instants, which a larger span could overflow.
            let seconds = |flag: &str, value: f64| {
                if value > 0.0 && value <= 86_400.0 {
                    Ok(std::time::Duration::from_secs_f64(value))
                } else {
                    Err(anyhow::anyhow!(
                        "{flag} {value}: expected a number of seconds above 0, at most 86400"
                    ))
                }
            };
            let listen = crate::serve::Listen {
                host: args.host.clone(),
                port: args.port,
                queue: args.queue,
                cors_origins: args.cors_origin.clone(),
                allowed_hosts: args.allowed_host.clone(),
                limits: crate::serve::Limits {
                    header_timeout: seconds("--header-timeout", args.header_timeout)?,
                    body_timeout: seconds("--body-timeout", args.body_timeout)?,
                    max_connections: args.max_connections,
                },
                log: if args.quiet {
                    tracing::Level::WARN
                } else if args.verbose {
                    tracing::Level::DEBUG
                } else {
                    tracing::Level::INFO
                },
            };
            crate::serve::run(cli.model.as_deref(), settings, positionals, listen, serving)
        }
        Some(Command::Chat(args)) => {
            refuse_mpirun("coli chat")?;
            let (settings, positionals) = resolve(&args.args)?;
            crate::serve::chat::run(
                cli.model.as_deref(),
                settings,
                positionals,
                args.system.clone(),
            )
        }
        Some(Command::Settings) => {
            print!("{}", settings::table());
            Ok(ExitCode::SUCCESS)
        }
        None => {
            verbosity::set(if cli.quiet {
                Level::Quiet
            } else if cli.verbose {
                Level::Verbose
            } else {
                Level::Normal
            });
            let (mut pairs, numbers) = split_args(&cli.args)?;
            pairs.extend(cli.flag_settings(&pairs)?);
            let settings = Settings::from_process(&pairs)?;
            main_job(
                cli.model.as_deref(),
                &settings,
                Positionals::from_numbers(&numbers),
            )
        }
    }
}

impl Cli {
    /// The flags that stand for a setting, as `KEY=VALUE` pairs to go after `pairs` (the
    /// arguments'): `-p` and `-f` give PROMPT, `-n` NGEN. A flag whose key `pairs` also
    /// gives is refused naming both, before a prompt file is read.
    fn flag_settings(&self, pairs: &Pairs) -> Result<Pairs> {
        let given = [
            ("-p/--prompt", "PROMPT", self.prompt.is_some()),
            ("-f/--file", "PROMPT", self.file.is_some()),
            ("-n", "NGEN", self.ngen.is_some()),
        ];
        for (flag, key, _) in given.iter().filter(|(_, _, given)| *given) {
            if pairs.iter().any(|(name, _)| name == key) {
                bail!("{flag} and {key}= both give {key}: keep one of them");
            }
        }
        let mut flags = Vec::new();
        if let Some(prompt) = &self.prompt {
            flags.push(("PROMPT".to_string(), prompt.clone()));
        }
        if let Some(path) = &self.file {
            flags.push(("PROMPT".to_string(), read_prompt(path)?));
        }
        if let Some(ngen) = self.ngen {
            flags.push(("NGEN".to_string(), ngen.to_string()));
        }
        Ok(flags)
    }
}

/// `-f PATH`: the prompt in the file at `path`, or on standard input for `-`, as UTF-8 text
/// less one final newline (which an editor or `echo` adds, and a tokenizer would read).
fn read_prompt(path: &Path) -> Result<String> {
    let (bytes, name) = if path == Path::new("-") {
        let mut bytes = Vec::new();
        std::io::stdin()
            .read_to_end(&mut bytes)
            .context("-f -: cannot read the prompt from standard input")?;
        (bytes, "standard input".to_string())
    } else {
        let bytes = crate::files::read_input(path)
            .with_context(|| format!("-f {}: cannot read the prompt file", path.display()))?;
        (bytes, path.display().to_string())
    };
    let mut text = String::from_utf8(bytes).map_err(|err| {
        anyhow::anyhow!(
            "-f: the prompt in {name} is not UTF-8 text (byte {})",
            err.utf8_error().valid_up_to()
        )
    })?;
    if text.ends_with('\n') {
        text.pop();
        if text.ends_with('\r') {
            text.pop();
        }
    }
    Ok(text)
}

/// The settings and positionals of `args`: `KEY=VALUE` over the environment, then the
/// numbers.
fn resolve(args: &[String]) -> Result<(Settings, Positionals)> {
    let (pairs, numbers) = split_args(args)?;
    let settings = Settings::from_process(&pairs)?;
    Ok((settings, Positionals::from_numbers(&numbers)))
}

/// `coli convert`.
fn convert(args: &ConvertArgs) -> Result<ExitCode> {
    if !(args.shard_gb.is_finite() && args.shard_gb > 0.0) {
        bail!(
            "--shard-gb {}: the largest shard must be a positive number of GB (default 4)",
            args.shard_gb
        );
    }
    let dense_bits = args.dense_bits.unwrap_or(args.bits);
    let options = crate::convert::Options {
        expert_bits: args.expert_bits.unwrap_or(args.bits),
        dense_bits,
        io_bits: args.io_bits.unwrap_or(dense_bits.for_io()),
        group_size: args.group_size,
        shard_bytes: (args.shard_gb * 1e9) as u64,
        model: args.model.clone(),
    };
    let summary = crate::convert::convert(&args.src, &args.dst, &options)?;
    println!("{}", crate::convert::report(&summary, &args.dst));
    Ok(ExitCode::SUCCESS)
}

/// The main job, as one process or as an MPI job's rank (the trunk runs the job; every
/// other rank serves its experts).
fn main_job(
    model: Option<&str>,
    settings: &Settings,
    positionals: Positionals,
) -> Result<ExitCode> {
    #[cfg(feature = "mpi")]
    let job = crate::cluster::start()?;
    #[cfg(feature = "mpi")]
    if let Some(job) = job.as_ref().filter(|job| job.rank > 0) {
        let served = crate::cluster::serve(model, settings, positionals, job);
        if let Err(err) = &served {
            eprintln!("error: rank {}: {err:#}", job.rank);
            job.abort(2);
        }
        return served;
    }
    #[cfg(not(feature = "mpi"))]
    if startup::launched_by_mpirun() {
        bail!("this coli was built without MPI, so each of mpirun's ranks would run the whole model and write the same history: build it with `cargo build --release --features mpi`, or run it without mpirun");
    }
    let result = crate::run::main_job(model, settings, positionals);
    #[cfg(feature = "mpi")]
    if let Some(job) = &job {
        // A rank that stopped answering would hold up MPI's orderly end: end them all, also
        // when its timeout only cost a report and the run itself ended.
        let failed = match &result {
            Err(err) => Some(format!("{err:#}")),
            Ok(_) if crate::cluster::timed_out() => Some(
                "an expert rank did not answer within MPI_TIMEOUT (above); the job ends here"
                    .to_string(),
            ),
            Ok(_) => None,
        };
        if let Some(why) = failed {
            eprintln!("error: {why}");
            job.abort(2);
        }
    }
    result
}

/// `what` runs as one process: under `mpirun` every rank would serve the same port and
/// history.
fn refuse_mpirun(what: &str) -> Result<()> {
    if startup::launched_by_mpirun() {
        bail!("{what} runs as one process, not under mpirun; an MPI job runs the main job (`mpirun -np N coli SNAP=...`)");
    }
    Ok(())
}

/// `KEY=VALUE` pairs, in order.
type Pairs = Vec<(String, String)>;

/// Separate `KEY=VALUE` arguments from the numeric positionals.
fn split_args(args: &[String]) -> Result<(Pairs, Vec<u32>)> {
    let mut pairs = Vec::new();
    let mut numbers = Vec::new();
    for arg in args {
        if let Some((key, value)) = arg.split_once('=') {
            if key.is_empty() || !key.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
                bail!(
                    "argument {arg:?}: expected KEY=VALUE with KEY made of letters, digits and _"
                );
            }
            pairs.push((key.to_string(), value.to_string()));
        } else {
            let Ok(number) = arg.parse::<u32>() else {
                bail!("argument {arg:?}: expected KEY=VALUE or a number (CAP [EBITS [DBITS]])");
            };
            numbers.push(number);
        }
    }
    if numbers.len() > 3 {
        bail!("too many numbers {numbers:?}: expected at most CAP EBITS DBITS");
    }
    Ok((pairs, numbers))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_pairs_and_positionals() {
        let args: Vec<String> = ["SNAP=/m", "64", "TF=1", "16"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let (pairs, numbers) = split_args(&args).unwrap();
        assert_eq!(
            pairs,
            vec![("SNAP".into(), "/m".into()), ("TF".into(), "1".into())]
        );
        assert_eq!(numbers, vec![64, 16]);
        assert!(split_args(&["x".to_string()]).is_err());
        assert!(split_args(&["1".into(), "2".into(), "3".into(), "4".into()]).is_err());
        assert!(split_args(&["A-B=1".into()]).is_err());
    }
}
