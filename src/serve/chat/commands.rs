//! What a line typed into `coli chat` is: a message for the model, or one of the chat's
//! commands (a `/word`), which the chat answers itself.

/// One line typed.
#[derive(Debug, PartialEq, Eq)]
pub enum Line<'a> {
    /// A message for the model.
    Message(&'a str),
    Command(Command<'a>),
}

/// One of the chat's commands.
#[derive(Debug, PartialEq, Eq)]
pub enum Command<'a> {
    Help,
    /// `/system TEXT` sets the system prompt; `/system` alone shows it.
    System(Option<&'a str>),
    Reset,
    Save(&'a str),
    Load(&'a str),
    Stats,
    Exit,
    /// A command given wrong, with what to say about it.
    Wrong(String),
}

/// `/help`'s list.
pub const HELP: &str = "\
commands (the chat answers them; the model sees none):
  /help          this list
  /system TEXT   set the system prompt of the conversation (/system alone shows it)
  /reset         start a new conversation, keeping the system prompt
  /save FILE     write the conversation to FILE as JSON
  /load FILE     continue the conversation in FILE (a bad file changes nothing)
  /stats         the last turn's tokens and speed, the expert cache's hit rate
  /exit          leave (Ctrl-D on an empty line too)
  //TEXT         send /TEXT to the model
keys: Left/Right, Home/End and Ctrl-W edit the line; Up/Down recall earlier lines;
Ctrl-C stops an answer (at the prompt it says how to leave)";

/// What `line` (not blank) asks for.
pub fn parse<'a>(line: &'a str) -> Line<'a> {
    let Some(command) = line.trim_start().strip_prefix('/') else {
        return Line::Message(line);
    };
    if command.starts_with('/') {
        return Line::Message(command);
    }
    let (word, argument) = match command.split_once(char::is_whitespace) {
        Some((word, rest)) => (word, Some(rest.trim()).filter(|rest| !rest.is_empty())),
        None => (command.trim_end(), None),
    };
    let bare = |command: Command<'static>| match argument {
        None => command,
        Some(_) => Command::Wrong(format!("/{word} takes no argument")),
    };
    let file = |command: fn(&'a str) -> Command<'a>| match argument {
        Some(path) => command(path),
        None => Command::Wrong(format!("/{word} needs a FILE: /{word} FILE")),
    };
    Line::Command(match word {
        "help" => bare(Command::Help),
        "system" => Command::System(argument),
        "reset" => bare(Command::Reset),
        "save" => file(Command::Save),
        "load" => file(Command::Load),
        "stats" => bare(Command::Stats),
        "exit" => bare(Command::Exit),
        _ => Command::Wrong(format!(
            "/{word}: unknown command (/help lists the commands; //{word} sends /{word} to the model)"
        )),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_are_messages_commands_or_wrong() {
        assert_eq!(parse("hello /there"), Line::Message("hello /there"));
        assert_eq!(parse("//usr is a path"), Line::Message("/usr is a path"));
        let command = |line| match parse(line) {
            Line::Command(command) => command,
            Line::Message(text) => panic!("{line}: a message, {text:?}"),
        };
        assert_eq!(command("/help"), Command::Help);
        assert_eq!(command(" /exit "), Command::Exit);
        assert_eq!(command("/system"), Command::System(None));
        assert_eq!(
            command("/system  Be brief. "),
            Command::System(Some("Be brief."))
        );
        assert_eq!(command("/save my talk.json"), Command::Save("my talk.json"));
        assert_eq!(command("/load\ta.json"), Command::Load("a.json"));
        assert_eq!(command("/reset"), Command::Reset);
        assert_eq!(command("/stats"), Command::Stats);
        let wrong = |line| match command(line) {
            Command::Wrong(message) => message,
            other => panic!("{line}: {other:?}"),
        };
        assert!(wrong("/save").contains("needs a FILE"));
        assert!(wrong("/reset now").contains("takes no argument"));
        let unknown = wrong("/quit");
        assert!(unknown.starts_with("/quit: unknown command"), "{unknown}");
        assert!(unknown.contains("/help"), "{unknown}");
        assert!(HELP.contains("/system TEXT") && HELP.contains("/load FILE"));
    }
}
