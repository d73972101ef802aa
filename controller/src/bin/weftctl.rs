fn main() -> std::process::ExitCode {
    weft_controller::weftctl::main()
}
