//! The settings table of docs/CONFIGURATION.md against the real command line: every flag of
//! `ragscope serve` (the global telemetry flags included) has a row that names the flag and its
//! environment variable, and every flag the table names is one `serve` takes.

use std::collections::{BTreeMap, BTreeSet};

use clap::{ArgAction, CommandFactory};
use ragscope::config::Cli;

/// The reference page, and the heading of the section whose table lists the server's settings.
const PAGE: &str = "docs/CONFIGURATION.md";
const SECTION: &str = "\n## Server settings\n";

/// A flag of `serve`: its environment variable, if it has one, and whether `--help` hides it.
struct Flag {
    env: Option<String>,
    hidden: bool,
}

/// Every long flag of `ragscope serve`, as `--name`. The command is built first, so the global
/// flags have reached the subcommand; clap's own `--help` and `--version` are left out.
fn serve_flags() -> BTreeMap<String, Flag> {
    let mut cli = Cli::command();
    cli.build();
    let serve = cli.find_subcommand("serve").expect("a serve subcommand");
    serve
        .get_arguments()
        .filter(|arg| {
            !matches!(
                arg.get_action(),
                ArgAction::Help | ArgAction::HelpShort | ArgAction::HelpLong | ArgAction::Version
            )
        })
        .filter_map(|arg| {
            let flag = Flag {
                env: arg.get_env().map(|env| env.to_string_lossy().into_owned()),
                hidden: arg.is_hide_set(),
            };
            Some((format!("--{}", arg.get_long()?), flag))
        })
        .collect()
}

/// The `code` spans of a table cell.
fn code_spans(cell: &str) -> impl Iterator<Item = &str> {
    cell.split('`').skip(1).step_by(2)
}

/// Each `--flag` in the table's flag column (the second), with the code spans of its row's
/// variable column (the first).
fn documented_flags() -> BTreeMap<String, BTreeSet<String>> {
    let path = crate::helpers::repo_dir().join(PAGE);
    let page = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    let section = page
        .split(SECTION)
        .nth(1)
        .unwrap_or_else(|| panic!("{PAGE} has no {SECTION:?} section"));
    let section = section.split("\n## ").next().unwrap();
    let mut flags: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for line in section.lines().filter(|l| l.starts_with('|')) {
        let cells: Vec<&str> = line.trim_matches('|').split(" | ").collect();
        if cells.len() < 2 {
            continue;
        }
        let variables: BTreeSet<String> = code_spans(cells[0]).map(str::to_string).collect();
        for flag in code_spans(cells[1]).filter(|span| span.starts_with("--")) {
            flags
                .entry(flag.to_string())
                .or_default()
                .extend(variables.iter().cloned());
        }
    }
    flags
}

#[test]
fn every_serve_flag_has_a_row_naming_its_variable() {
    let flags = serve_flags();
    assert!(
        flags.len() >= 60,
        "too few flags found on serve: {}",
        flags.len()
    );
    assert!(
        flags.contains_key("--trace-buffer"),
        "the global telemetry flags did not reach serve"
    );
    let documented = documented_flags();
    let mut problems = Vec::new();
    for (name, flag) in flags.iter().filter(|(_, flag)| !flag.hidden) {
        match documented.get(name) {
            None => problems.push(format!("{name} has no row")),
            Some(variables) => {
                if let Some(env) = &flag.env {
                    if !variables.contains(env) {
                        problems.push(format!("the row of {name} does not name {env}"));
                    }
                }
            }
        }
    }
    assert!(
        problems.is_empty(),
        "{PAGE} against `ragscope serve`: {problems:?}"
    );
}

#[test]
fn every_flag_the_table_names_is_one_serve_takes() {
    let flags = serve_flags();
    let documented = documented_flags();
    assert!(documented.len() >= 60, "{PAGE}: {documented:?}");
    let unknown: Vec<&String> = documented
        .keys()
        .filter(|name| !flags.contains_key(*name))
        .collect();
    assert!(
        unknown.is_empty(),
        "{PAGE} lists flags that `ragscope serve` does not take: {unknown:?}"
    );
}
