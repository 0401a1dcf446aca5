"""`fw generate`: one prompt through the engine, streamed to the terminal."""

from __future__ import annotations

import argparse
import sys

from fw.config import add_config_arguments, resolve_config

NAME = "generate"
HELP = "Generate text for one prompt, streaming it to the terminal."


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", required=True, help="The prompt text (use --chat to wrap it in the chat template).")
    p.add_argument("--chat", action="store_true", help="Send the prompt as a user message through the chat template.")
    p.add_argument("--system", default=None, help="A system message (with --chat).")
    s = p.add_argument_group("sampling")
    s.add_argument("--max-tokens", type=int, default=256)
    s.add_argument("--min-tokens", type=int, default=0)
    s.add_argument("--temperature", type=float, default=1.0)
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--top-k", type=int, default=0)
    s.add_argument("--min-p", type=float, default=0.0)
    s.add_argument("--repetition-penalty", type=float, default=1.0)
    s.add_argument("--frequency-penalty", type=float, default=0.0)
    s.add_argument("--presence-penalty", type=float, default=0.0)
    s.add_argument("--request-seed", type=int, default=None, dest="request_seed",
                   help="Seed of this request's sampling (reproducible output).")
    s.add_argument("--stop", action="append", default=None, help="Stop string (repeatable).")
    s.add_argument("--ignore-eos", action="store_true")
    add_config_arguments(p)


def run(args: argparse.Namespace) -> int:
    # here (all of run's imports): building `fw`'s parser imports this module, and `fw --help` stays light
    from fw.default_model import default_model
    from fw.llm import LLM
    from fw.sampling.params import SamplingParams
    from fw.warm.startup import resume_collector

    config = resolve_config(cli=vars(args), config_file=args.config)
    from fw.distributed.backend import prepare_process  # here: as above

    # --distributed-executor-backend: under torchrun (external_launcher) ranks other than 0 become workers here
    config = prepare_process(config)
    if config.node_rank > 0:  # this machine runs tensor-parallel workers only; node 0 generates
        from fw.distributed.node import run_node  # here: as above

        return run_node(config)
    if config.model is None:
        config.model = default_model()
    params = SamplingParams(
        max_tokens=args.max_tokens, min_tokens=args.min_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
        frequency_penalty=args.frequency_penalty, presence_penalty=args.presence_penalty, seed=args.request_seed,
        stop=args.stop, ignore_eos=args.ignore_eos,
    )
    llm = LLM(**{k: v for k, v in vars(config).items()})
    resume_collector()  # paused by `fw` for this start-up (fw.cli.main.STARTS_AN_ENGINE)
    prompt: object = args.prompt
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        messages.append({"role": "user", "content": args.prompt})
        prompt = llm.apply_chat_template(messages)
    for out in llm.stream(prompt, params):
        sys.stdout.write(out.outputs[0].text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0
