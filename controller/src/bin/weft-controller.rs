fn main() -> std::process::ExitCode {
    weft_controller::cli::main()
}
