//! `nm-gateway`'s command line: parses flags, resolves settings (exit 64 on bad ones), starts
//! the chosen process shape and stops it gracefully on SIGTERM or Ctrl-C. `src/main.rs` only
//! sets the allocator and calls [`main`].

use std::collections::HashMap;
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use crate::cli::{
    AgentsCommand, AlertsCommand, AuditArgs, BudgetsCommand, ExperimentsCommand, KeysCommand,
    SignalsCommand, UsageArgs, UsageError,
};
use crate::config::{self, Flags, Mode};
use crate::{app, telemetry};
use clap::{Args, Parser, Subcommand};

/// The target of this module's log lines: the binary's crate name, where they were written
/// before the command line moved into the library (a filter such as `NM_LOG=nm_gateway=warn`
/// reads the same).
const LOG_TARGET: &str = "nm_gateway";

/// Exit code for bad settings or usage (BSD `EX_USAGE`).
const EXIT_USAGE: u8 = 64;

#[derive(Debug, Parser)]
#[command(name = "nm-gateway", version = crate::VERSION, about = "LLM gateway: transparent provider proxy with signals, usage and keys")]
struct Cli {
    /// TOML settings file (flags > env > file > defaults).
    #[arg(long, global = true, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Log format: text or json (env NM_LOG_FORMAT).
    #[arg(long, global = true, value_name = "FORMAT")]
    log_format: Option<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Dataplane and controlplane in one process, on an embedded SQLite database by default.
    Serve(ServerArgs),
    /// Only the dataplane (HTTP proxy); needs a controlplane (NM_CONTROLPLANE_URL).
    Dataplane(ServerArgs),
    /// Only the controlplane (gRPC + database).
    Controlplane(ServerArgs),
    /// Fill a fresh database with synthetic traffic and signals for a few agents, and compute
    /// their analytics (then `serve` and `agents recommend <agent>`).
    Demo(crate::demo::DemoArgs),
    /// Signal counts and analytics per agent (needs NM_ADMIN_KEY).
    Agents {
        #[command(flatten)]
        client: ClientArgs,
        #[command(subcommand)]
        command: AgentsCommand,
    },
    /// Stored signals (explicit and implicit) of an agent or a session (needs NM_ADMIN_KEY).
    Signals {
        #[command(flatten)]
        client: ClientArgs,
        #[command(subcommand)]
        command: SignalsCommand,
    },
    /// Manage API keys: roles, scopes, labels, expiry, rotation (needs NM_ADMIN_KEY; a viewer
    /// key may list).
    Keys {
        #[command(flatten)]
        client: ClientArgs,
        #[command(subcommand)]
        command: KeysCommand,
    },
    /// Per-end-user budgets (needs NM_ADMIN_KEY).
    Budgets {
        #[command(flatten)]
        client: ClientArgs,
        #[command(subcommand)]
        command: BudgetsCommand,
    },
    /// Randomised experiments: an agent's sessions split between models, with a decision that
    /// holds however often one looks (needs NM_ADMIN_KEY; a viewer key may list, show and read
    /// the history).
    Experiments {
        #[command(flatten)]
        client: ClientArgs,
        #[command(subcommand)]
        command: ExperimentsCommand,
    },
    /// Usage and cost over a time range, grouped by agent, session, user, env, provider, model,
    /// key, day or week (needs NM_ADMIN_KEY).
    Usage {
        #[command(flatten)]
        client: ClientArgs,
        #[command(flatten)]
        args: UsageArgs,
    },
    /// The audit trail: every admin change, who made it, when, before and after (needs
    /// NM_ADMIN_KEY, an admin or viewer key).
    Audit {
        #[command(flatten)]
        client: ClientArgs,
        #[command(flatten)]
        args: AuditArgs,
    },
    /// Webhooks for alerts (budgets, key expiry, recommendations, experiments) and their
    /// deliveries (needs NM_ADMIN_KEY; a viewer key may list).
    Alerts {
        #[command(flatten)]
        client: ClientArgs,
        #[command(subcommand)]
        command: AlertsCommand,
    },
    /// End users: `forget USER` erases an NM-User value from everything stored (needs
    /// NM_ADMIN_KEY, an admin key).
    Users {
        #[command(flatten)]
        client: ClientArgs,
        #[command(subcommand)]
        command: crate::cli::UsersCommand,
    },
    /// Write request records or signals to files, one per UTC day (Parquet or JSON lines), in a
    /// folder or on S3, for a warehouse; reads the database itself (NM_DATABASE_URL).
    Export(crate::export::ExportArgs),
}

#[derive(Debug, Clone, Default, Args)]
struct ServerArgs {
    /// Dataplane listen address (env NM_HTTP_ADDR).
    #[arg(long)]
    http_addr: Option<String>,
    /// Controlplane listen address (env NM_GRPC_ADDR).
    #[arg(long)]
    grpc_addr: Option<String>,
    /// Controlplane URL for a dataplane (env NM_CONTROLPLANE_URL).
    #[arg(long)]
    controlplane_url: Option<String>,
    /// Database URL (env NM_DATABASE_URL).
    #[arg(long)]
    database_url: Option<String>,
    /// Shared secret of the link between dataplanes and the controlplane (env NM_LINK_SECRET;
    /// prefer the environment or the config file: a command line is visible to other users).
    #[arg(long, value_name = "SECRET")]
    link_secret: Option<String>,
}

#[derive(Debug, Clone, Default, Args)]
struct ClientArgs {
    /// Controlplane URL (env NM_CONTROLPLANE_URL).
    #[arg(long, global = true)]
    controlplane_url: Option<String>,
    /// Admin key presented to the controlplane (env NM_ADMIN_KEY).
    #[arg(long, global = true)]
    admin_key: Option<String>,
}

/// The command line and everything it starts, in the library: the binary compiles only this
/// function and the allocator. An `async` body is compiled into the crate that polls it, so the
/// binary's `run` once compiled the whole gateway a second time (the library had it too): 1.8M
/// lines of LLVM IR for a 500-line file (bench/HISTORY.md, "Session 25: the first build").
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("nm-gateway: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let code = runtime.block_on(run(cli));
    telemetry::flush();
    code
}

async fn run(cli: Cli) -> ExitCode {
    let client_flags = |c: ClientArgs| Flags {
        controlplane_url: c.controlplane_url,
        admin_key: c.admin_key,
        ..Flags::default()
    };
    let mut demo_seed = None;
    let mut export_args = None;
    let (mode, flags, admin_cmd) = match cli.command {
        Command::Demo(a) => {
            demo_seed = Some(a.seed);
            (
                Mode::Serve,
                Flags {
                    database_url: a.database_url,
                    ..Flags::default()
                },
                None,
            )
        }
        Command::Serve(a) => (Mode::Serve, server_flags(a), None),
        Command::Dataplane(a) => (Mode::Dataplane, server_flags(a), None),
        Command::Controlplane(a) => (Mode::Controlplane, server_flags(a), None),
        Command::Keys { client, command } => (
            Mode::Client,
            client_flags(client),
            Some(AdminCommand::Keys(command)),
        ),
        Command::Agents { client, command } => (
            Mode::Client,
            client_flags(client),
            Some(AdminCommand::Agents(command)),
        ),
        Command::Signals { client, command } => (
            Mode::Client,
            client_flags(client),
            Some(AdminCommand::Signals(command)),
        ),
        Command::Budgets { client, command } => (
            Mode::Client,
            client_flags(client),
            Some(AdminCommand::Budgets(command)),
        ),
        Command::Experiments { client, command } => (
            Mode::Client,
            client_flags(client),
            Some(AdminCommand::Experiments(command)),
        ),
        Command::Usage { client, args } => (
            Mode::Client,
            client_flags(client),
            Some(AdminCommand::Usage(args)),
        ),
        Command::Audit { client, args } => (
            Mode::Client,
            client_flags(client),
            Some(AdminCommand::Audit(args)),
        ),
        Command::Alerts { client, command } => (
            Mode::Client,
            client_flags(client),
            Some(AdminCommand::Alerts(command)),
        ),
        Command::Users { client, command } => (
            Mode::Client,
            client_flags(client),
            Some(AdminCommand::Users(command)),
        ),
        Command::Export(a) => {
            let flags = Flags {
                database_url: a.database_url.clone(),
                ..Flags::default()
            };
            export_args = Some(a);
            (Mode::Serve, flags, None)
        }
    };
    let flags = Flags {
        log_format: cli.log_format,
        ..flags
    };
    let env: HashMap<String, String> = std::env::vars().collect();
    let file = match cli.config.as_deref().map(config::load_file).transpose() {
        Ok(f) => f.unwrap_or_default(),
        Err(e) => return usage(&e.to_string()),
    };
    let settings = match config::resolve(mode, &flags, &env, file) {
        Ok(s) => s,
        Err(e) => return usage(&e.to_string()),
    };
    if let Err(e) = telemetry::init(&settings.log, settings.log_format) {
        return usage(&format!("NM_LOG: {e}"));
    }
    if admin_cmd.is_none() {
        match crate::limits::raise_nofile() {
            Ok((before, after)) if before != after => {
                tracing::info!(target: LOG_TARGET, ?before, ?after, "open-file limit raised to the hard limit");
            }
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(target: LOG_TARGET, error = %e, "cannot raise the open-file limit")
            }
        }
    }

    if let Some(seed) = demo_seed {
        let mut stdout = std::io::stdout().lock();
        return match crate::demo::run(&settings, seed, &mut stdout).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) if e.is::<UsageError>() => usage(&e.to_string()),
            Err(e) => {
                eprintln!("nm-gateway: {e:#}");
                ExitCode::FAILURE
            }
        };
    }

    if let Some(a) = export_args {
        return export(&settings, &a, &env).await;
    }

    if let Some(cmd) = admin_cmd {
        let mut stdout = std::io::stdout().lock();
        let done = match cmd {
            AdminCommand::Keys(c) => crate::cli::keys(&settings, c, &mut stdout).await,
            AdminCommand::Agents(c) => crate::cli::agents(&settings, c, &mut stdout).await,
            AdminCommand::Budgets(c) => crate::cli::budgets(&settings, c, &mut stdout).await,
            AdminCommand::Signals(c) => crate::cli::signals(&settings, c, &mut stdout).await,
            AdminCommand::Experiments(c) => {
                crate::cli::experiments(&settings, c, &mut stdout).await
            }
            AdminCommand::Usage(a) => crate::cli::usage(&settings, a, &mut stdout).await,
            AdminCommand::Audit(a) => crate::cli::audit(&settings, a, &mut stdout).await,
            AdminCommand::Alerts(c) => crate::cli::alerts(&settings, c, &mut stdout).await,
            AdminCommand::Users(c) => crate::cli::users(&settings, c, &mut stdout).await,
        };
        return match done {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) if e.is::<UsageError>() => usage(&e.to_string()),
            Err(e) => {
                eprintln!("nm-gateway: {e:#}");
                ExitCode::FAILURE
            }
        };
    }

    let running = match app::start(&settings).await {
        Ok(r) => r,
        Err(e) if e.is::<UsageError>() => return usage(&e.to_string()),
        Err(e) => {
            tracing::error!(target: LOG_TARGET, error = format!("{e:#}"), "startup failed");
            telemetry::flush();
            eprintln!("nm-gateway: {e:#}");
            return ExitCode::FAILURE;
        }
    };
    if let Some(secret) = &running.generated_admin_key {
        show_generated_key(secret);
    }
    wait_for_signal().await;
    tracing::info!(target: LOG_TARGET, "shutdown requested");
    match running.stop().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(target: LOG_TARGET, error = format!("{e:#}"), "stopped with an error");
            ExitCode::FAILURE
        }
    }
}

/// `nm-gateway export`: bad arguments exit 64 before the database is opened.
async fn export(
    settings: &config::Settings,
    a: &crate::export::ExportArgs,
    env: &HashMap<String, String>,
) -> ExitCode {
    use crate::export::{Destination, Plan, S3};
    let plan = match Plan::from_args(a, chrono::Utc::now()) {
        Ok(p) => p,
        Err(e) => return usage(&e.to_string()),
    };
    if let Destination::S3 { bucket, prefix } = &plan.to
        && let Err(e) = S3::from_env(env, bucket, prefix)
    {
        return usage(&e.to_string());
    }
    let store = match nm_controlplane::store::Store::connect(&settings.database_url).await {
        Ok(s) => s,
        Err(e) => {
            eprintln!("nm-gateway: export: cannot open the database: {e}");
            return ExitCode::FAILURE;
        }
    };
    let mut stdout = std::io::stdout().lock();
    let done = crate::export::run(&store, &plan, env, &mut stdout).await;
    let _ = store.close().await;
    match done {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("nm-gateway: export: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// The admin commands, which talk gRPC to a controlplane and start no server.
enum AdminCommand {
    Keys(KeysCommand),
    Agents(AgentsCommand),
    Budgets(BudgetsCommand),
    Signals(SignalsCommand),
    Experiments(ExperimentsCommand),
    Usage(UsageArgs),
    Audit(AuditArgs),
    Alerts(AlertsCommand),
    Users(crate::cli::UsersCommand),
}

fn server_flags(a: ServerArgs) -> Flags {
    Flags {
        http_addr: a.http_addr,
        grpc_addr: a.grpc_addr,
        controlplane_url: a.controlplane_url,
        database_url: a.database_url,
        link_secret: a.link_secret,
        ..Flags::default()
    }
}

fn usage(msg: &str) -> ExitCode {
    eprintln!("nm-gateway: {msg}");
    ExitCode::from(EXIT_USAGE)
}

/// The generated first admin key goes to stdout once, outside the logs.
fn show_generated_key(secret: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(
        out,
        "\nNo keys existed, so an admin key was generated. It is shown only now:\n\n    {secret}\n\nUse it as NM-Key on requests and as NM_ADMIN_KEY for `nm-gateway keys`.\n"
    );
    let _ = out.flush();
}

async fn wait_for_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = ctrl_c => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = ctrl_c.await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use clap::{CommandFactory, FromArgMatches};

    use super::*;

    /// The flags that carry settings (the server commands', the admin commands', the global
    /// `--log-format`) are the flags the rows in `src/config` declare, and each one's help names
    /// its variable.
    #[test]
    fn settings_flags_are_the_declared_ones() {
        let server = ServerArgs::augment_args(clap::Command::new("server"));
        let client = ClientArgs::augment_args(clap::Command::new("client"));
        let top = Cli::command();
        let args = server
            .get_arguments()
            .chain(client.get_arguments())
            .chain(top.get_arguments().filter(|a| a.get_id() != "config"))
            .filter_map(|a| Some((a.get_long()?, a.get_help()?.to_string())));
        let mut seen = BTreeSet::new();
        for (long, help) in args {
            let row = config::all()
                .find(|m| m.flag.is_some_and(|f| f.long == long))
                .unwrap_or_else(|| panic!("--{long}: no setting declares it"));
            assert!(
                help.contains(row.env),
                "--{long}: its help does not name {}",
                row.env
            );
            seen.insert(long);
        }
        for m in config::all() {
            if let Some(f) = m.flag {
                assert!(
                    seen.contains(f.long),
                    "{}: --{} is declared, not in clap",
                    m.env,
                    f.long
                );
            }
        }
        // And clap's values reach the rows' getters.
        let parsed = Cli::from_arg_matches(&Cli::command().get_matches_from([
            "nm-gateway",
            "--log-format",
            "json",
            "serve",
            "--http-addr",
            "127.0.0.1:1",
        ]))
        .unwrap_or_else(|e| panic!("{e}"));
        let Command::Serve(a) = parsed.command else {
            panic!("not serve");
        };
        let flags = Flags {
            log_format: parsed.log_format,
            ..server_flags(a)
        };
        let settings = config::resolve(
            Mode::Serve,
            &flags,
            &HashMap::new(),
            config::FileSettings::default(),
        )
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(settings.http_addr.port(), 1);
        assert_eq!(settings.log_format, config::LogFormat::Json);
    }
}
