"""The `xlaserve` command: convert, generate, serve, worker, bench."""

from __future__ import annotations

import argparse
import logging
import sys


def _convert(args: argparse.Namespace) -> int:
    from xlaserve.checkpoints.convert import convert_gguf, convert_hf

    fn = convert_gguf if args.format == "gguf" else convert_hf
    config = fn(args.src, args.out, overwrite=args.overwrite, quiet=args.quiet,
                quantize=args.quantize)
    print(f"wrote {args.out}: {config.architecture}, {config.num_layers} layers, "
          f"{config.num_params / 1e6:.1f}M parameters"
          + (f", {config.quantization} weights" if config.quantization else ""))
    return 0


def _generate(args: argparse.Namespace) -> int:
    from xlaserve.serving.generate import generate_text, single_request_engine
    from xlaserve.serving.types import SamplingParams

    engine = single_request_engine(args.model, args.max_len, dtype=args.dtype,
                                   attention_backend=args.attention_backend)
    tok = engine.tokenizer
    if args.chat is not None:
        prompt = tok.encode_chat([{"role": "user", "content": args.chat}])
    else:
        prompt = tok.encode(args.prompt)
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                              top_p=args.top_p, seed=args.seed)
    for text in generate_text(engine, prompt, sampling):
        sys.stdout.write(text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def _serve_or_worker(command: str, argv: list[str]) -> int:
    # the servers' start-up lines (attention backend and dtype, step costs, ...) on stderr
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("xlaserve").setLevel(logging.INFO)
    if command == "serve":
        from xlaserve.serving.http.server import serve_main

        return serve_main(argv)
    from xlaserve.serving.grpc.worker import worker_main

    return worker_main(argv)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="xlaserve", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("convert", help="convert a GGUF file or HF folder into a model folder")
    c.add_argument("format", choices=["gguf", "hf"])
    c.add_argument("src", help="GGUF file, or HF folder with config.json + *.safetensors")
    c.add_argument("out", help="output model folder")
    c.add_argument("--overwrite", action="store_true")
    c.add_argument("--quiet", action="store_true", help="no progress bar")
    c.add_argument("--quantize", choices=["int8", "fp8"], default=None,
                   help="store the layer matrices as int8 (or fp8 e4m3, a GPU option) with a "
                        "float32 scale per 32 weights along K (weight-only; a float folder can "
                        "also be quantized at load); GGUF Q8_0 tensors are copied into int8 "
                        "as they are")
    c.set_defaults(fn=_convert)

    g = sub.add_parser("generate", help="generate from one prompt, streamed to the terminal")
    g.add_argument("--model", required=True, help="model folder written by `xlaserve convert`")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="raw prompt text")
    src.add_argument("--chat", help="one user message, rendered with the chat template")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--max-len", type=int, default=2048)
    g.add_argument("--dtype", default=None, help="float32 | bfloat16 (default: from config)")
    g.add_argument("--attention-backend", default="auto",
                   help="auto | reference | cpu | pallas | triton (see xlaserve/kernels)")
    g.set_defaults(fn=_generate)
    # `serve` and `worker` are dispatched before parsing (see main); listed here for --help.
    sub.add_parser("serve", help="the OpenAI-compatible HTTP server: serve --config FILE")
    sub.add_parser("worker", help="one engine replica behind gRPC: worker --config FILE")
    from xlaserve.bench.cli import add_bench_parser

    add_bench_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("serve", "worker", "generate", "bench"):
        from xlaserve.compile_cache import enable_compilation_cache

        enable_compilation_cache()
    if argv and argv[0] in ("serve", "worker"):  # they own their argument parsers
        return _serve_or_worker(argv[0], argv[1:])
    args = build_parser().parse_args(argv)
    from xlaserve.checkpoints.errors import CheckpointError

    try:
        return int(args.fn(args))
    except (CheckpointError, FileNotFoundError, ValueError) as e:
        print(f"xlaserve {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
