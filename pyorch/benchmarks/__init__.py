"""`pyorch bench {throughput,latency,startup,serve}`: each module has add_cli_args(parser) and
main(args), wired by pyorch/cli/main.py; each runs as `python -m pyorch.benchmarks.<name>` too."""
