"""vllm-ddtree's benchmarks and GPU checks, one package with one command line
(``python -m benchmarks COMMAND``, ``benchmarks/__main__.py``). Each run writes its results
under ``benchmarks/results/<date>_<commit>_<kind>/``."""
