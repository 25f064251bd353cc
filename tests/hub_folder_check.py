"""Load AngelSpec drafter Hub folders the way a user without the angelspec-hf library does (transformers + torch,
`trust_remote_code=True`) and run them. Run by `tests/test_hub_folders.py` in a fresh virtual environment that has no
angelspec-hf, or with `--block`, which makes `angelspec_hf` (and the repository's `modeling`, `tgi_patch`, `trainer`)
unimportable in this process. Imports nothing of this repository.

    python tests/hub_folder_check.py TARGET_FOLDER DRAFTER_FOLDER... [--block]

For each drafter folder: it loads with `AutoModel.from_pretrained(folder, trust_remote_code=True)` from the folder's
own code, without changing `GenerationMixin`; `propose` drafts a full block from the target's hidden states; a DFlash
drafter over the whole vocabulary gives the target's own greedy tokens through transformers' built-in DFlash path
(`speculation_type="dflash"`); every other drafter refuses `target.generate(assistant_model=...)` and the hook's
`get_candidate_generator` with errors naming `pip install angelspec-hf`. Prints one JSON line per folder."""

import importlib.abc
import json
import sys

BLOCKED = ("angelspec_hf", "modeling", "tgi_patch", "trainer")


class BlockLibrary(importlib.abc.MetaPathFinder):
    """Makes the library unimportable, as where it is not installed."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {fullname!r} (blocked)", name=fullname)
        return None


def generation_mixin_state():
    from transformers.generation import GenerationMixin

    return {name: value for name, value in vars(GenerationMixin).items()}


def check(target, tokenizer, folder: str) -> dict:
    import torch
    from transformers import AutoModel

    before = generation_mixin_state()
    drafter = AutoModel.from_pretrained(folder, trust_remote_code=True).to(torch.float32).eval()
    result = {"folder": folder, "class": type(drafter).__name__, "module": type(drafter).__module__,
              "generation_mixin_unchanged": generation_mixin_state() == before}
    prompt = "Write a Python function that returns the n-th Fibonacci number."
    ids = tokenizer(prompt, return_tensors="pt").input_ids if tokenizer is not None else torch.arange(3, 40)[None]
    layers = list(drafter.config.target_layer_ids)
    with torch.no_grad():
        hidden = target(ids, output_hidden_states=True).hidden_states
        features = torch.cat([hidden[i + 1] for i in layers], dim=-1)[:, :-1]  # the anchor's are not known yet
        tokens, q = drafter.propose(drafter.new_draft_state(), features, ids, drafter.num_draft_tokens,
                                    target.get_input_embeddings(), drafter.draft_lm_head(target.get_output_embeddings()))
    result["drafted"] = list(tokens.shape)
    result["draft_ok"] = tokens.shape == (1, drafter.num_draft_tokens) and q.shape[:2] == tokens.shape
    greedy = dict(max_new_tokens=24, do_sample=False, pad_token_id=tokenizer.eos_token_id if tokenizer else 0)
    plain = target.generate(ids, **greedy)
    if drafter.supports_transformers_dflash:
        out = target.generate(ids, assistant_model=drafter, speculation_type="dflash", **greedy)
        result["builtin_dflash_identical"] = bool(torch.equal(plain, out))
    else:
        try:
            target.generate(ids, assistant_model=drafter, **greedy)
            result["generate_error"] = None
        except AttributeError as error:
            result["generate_error"] = str(error)
    try:
        drafter.get_candidate_generator(target, ids, target.generation_config)
        result["hook_error"] = None
    except ImportError as error:
        result["hook_error"] = str(error)
    result["generation_mixin_unchanged"] &= generation_mixin_state() == before
    return result


def main(argv) -> int:
    block = "--block" in argv
    paths = [a for a in argv if a != "--block"]
    if block:
        sys.meta_path.insert(0, BlockLibrary())
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_pretrained(paths[0], dtype=torch.float32).eval()
    try:
        tokenizer = AutoTokenizer.from_pretrained(paths[0])
    except (OSError, ValueError):
        tokenizer = None  # a tiny test target without a tokenizer: token ids are made up
    try:
        import angelspec_hf  # noqa: F401
        library = True
    except ImportError:
        library = False
    for folder in paths[1:]:
        print(json.dumps({"library_importable": library, **check(target, tokenizer, folder)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
