//! The `tidelog` binary: parses the command line and dispatches. Nothing else lives here.

use std::process::ExitCode;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use tidelog::cli;

/// What every `--help` ends with.
const AFTER_HELP: &str = "\
Exit codes: 0 success; 1 the command failed (one line on stderr: error: <CODE>: <why>);
2 usage error (unknown flag, missing or malformed value).
The command-line contract (flags, table and JSON output) is docs/cli.md in the source tree.";

/// tidelog: a Kafka-style, partition-replicated log service.
#[derive(Debug, Parser)]
#[command(name = "tidelog", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run controller and broker in one process: the zero-setup single node.
    Standalone(cli::server_roles::StandaloneArgs),
    /// Run a broker: stores partitions, serves produce and fetch.
    Broker(cli::server_roles::BrokerArgs),
    /// Run a member of the metadata controller quorum (Raft).
    Controller(cli::controller::ControllerArgs),
    /// Create, list, describe, alter and delete topics.
    Topics(cli::topics::TopicsArgs),
    /// Produce records from stdin, one per line.
    Produce(cli::produce::ProduceArgs),
    /// Print records of a topic.
    Consume(cli::consume::ConsumeArgs),
    /// List, describe, reset and delete consumer groups.
    Groups(cli::groups::GroupsArgs),
    /// List and describe transactional ids (state, partitions, age, producer id/epoch).
    Transactions(cli::transactions::TransactionsArgs),
    /// Load generators: perf produce, perf consume.
    Perf(cli::perf::PerfArgs),
    /// Describe the controller quorum and the brokers.
    Cluster(cli::cluster::ClusterArgs),
    /// Decode segment files (.log, .index, .timeindex), like kafka-dump-log.sh.
    DumpLog(cli::dump_log::DumpLogArgs),
    /// Cancel scheduled (delayed) records before they are due.
    Scheduled(cli::scheduled::ScheduledArgs),
    /// Offline repair of a damaged partition: shows what it would drop; --execute applies.
    Repair(cli::repair::RepairArgs),
}

/// `cmd` and every subcommand under it, each `--help` ending with [`AFTER_HELP`].
fn with_after_help(cmd: clap::Command) -> clap::Command {
    cmd.after_help(AFTER_HELP).mut_subcommands(with_after_help)
}

fn main() -> ExitCode {
    cli::logging::init();
    // clap exits with 2 on usage errors (0 for --help and --version).
    let matches = with_after_help(Cli::command()).get_matches();
    let args = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    if !matches!(
        args.command,
        Command::Standalone(_) | Command::Broker(_) | Command::Controller(_)
    ) {
        // Client tools end quietly when their reader goes away (`... | head`), like other
        // Unix tools; servers keep Rust's default (ignored, so sockets report EPIPE).
        // SAFETY: restoring a signal's default disposition before any thread starts.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        }
    }
    let result = match &args.command {
        Command::Standalone(a) => cli::server_roles::run_standalone(a),
        Command::Broker(a) => cli::server_roles::run_broker(a),
        Command::Controller(a) => cli::controller::run(a),
        Command::Topics(a) => cli::topics::run(a),
        Command::Produce(a) => cli::produce::run(a),
        Command::Consume(a) => cli::consume::run(a),
        Command::Groups(a) => cli::groups::run(a),
        Command::Transactions(a) => cli::transactions::run(a),
        Command::Perf(a) => cli::perf::run(a),
        Command::Cluster(a) => cli::cluster::run(a),
        Command::DumpLog(a) => cli::dump_log::run(a),
        Command::Repair(a) => cli::repair::run(a),
        Command::Scheduled(a) => cli::scheduled::run(a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{e}");
            ExitCode::FAILURE
        }
    }
}
