"""Text generation as a job: a causal LM to a `.pte` with the runner's metadata and a tokenizer
`TextLLMRunner` loads, checked token by token and logit by logit against eager greedy decoding."""

import pytest
import torch

import compiler
from compiler.cli.main import main
from compiler.models import llm
from compiler.tools import generation

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def llama():
    return llm.text_model("llama", max_cache_len=32)


def test_the_tokenizer_round_trips_and_the_runners_tokenizer_reads_it_alike(llama, tmp_path):
    from pytorch_tokenizers.pytorch_tokenizers_cpp import HFTokenizer

    made = llm.tokenizer(llama)
    tokens = [5, 17, 9, 255]
    text = llm.prompt_text(tokens)
    assert made.encode(text).ids == [llama.bos, *tokens]
    assert made.encode(text, add_special_tokens=False).ids == tokens
    assert made.decode(tokens) == text
    assert made.get_vocab_size() == llama.vocab
    made.save(str(tmp_path / "tokenizer.json"))
    runners = HFTokenizer()
    runners.load(str(tmp_path / "tokenizer.json"))
    assert runners.encode(text, 1, 0) == [llama.bos, *tokens]  # num_bos=1
    assert runners.encode(text, 0, 0) == tokens
    assert (runners.bos_tok(), runners.eos_tok(), runners.vocab_size()) == (llama.bos, llama.eos[0], llama.vocab)
    assert [runners.decode(t, t) for t in tokens] == [llm.piece(t) for t in tokens]


def test_the_program_holds_the_runners_metadata(tmp_path):
    from executorch.runtime import Runtime

    job = compiler.generate("qwen3", "portable", tokens=2, output_dir=tmp_path, max_cache_len=16)
    program = Runtime.get().load_program(job.pte_path.read_bytes())
    read = {name: program.load_method(name).execute([]) for name in program.method_names if name != "forward"}
    assert read == {
        "get_max_seq_len": [16], "get_max_context_len": [16], "get_vocab_size": [256], "get_bos_id": [llm.BOS],
        "get_eos_ids": [llm.EOS], "use_kv_cache": [True], "enable_dynamic_shape": [False],
        "use_sdpa_with_kv_cache": [False],
    }
    assert job.tokenizer_path.is_file()


@pytest.mark.parametrize("backend", ["portable", pytest.param("xnnpack", marks=pytest.mark.slow)])
def test_text_llm_runner_generates_eagers_tokens(backend, tmp_path):
    job = compiler.generate("llama", backend, tokens=6, output_dir=tmp_path, check=True, max_cache_len=32)
    check = job.check
    assert check.runner == "TextLLMRunner"
    assert check.passed, check.describe()
    assert check.program_tokens == check.eager_tokens and len(check.eager_tokens) == 6
    assert check.first_difference is None
    assert check.worst_logit_error <= check.tolerance.absolute
    if backend == "xnnpack":
        assert check.prefill_ms_per_token is not None and check.decode_ms_per_token is not None


class Favouring(torch.nn.Module):
    """The decoder step with one token's logit raised from a cache position on: a wrong program
    for the same eager model, right until that position."""

    def __init__(self, step, token, from_position):
        super().__init__()
        self.step, self.token, self.from_position = step, token, from_position

    def forward(self, input_ids, cache_position):
        logits = self.step(input_ids, cache_position)
        raised = torch.nn.functional.one_hot(torch.tensor(self.token), logits.shape[-1]) * 100.0
        return logits + raised * (cache_position[0] >= self.from_position)


def test_a_wrong_program_is_caught_at_the_step_it_differs(llama):
    steps, differs_at = 5, 2
    prompt = generation.prompt_tokens(llama, generation.DEFAULT_PROMPT)
    eager = generation.eager_greedy(llama, prompt, steps)
    favoured = next(t for t in range(4, llama.vocab) if t not in eager.tokens)
    llama.reset()
    # Generated token i comes from the call at position len(prompt) - 1 + i (the prompt holds BOS).
    wrong = Favouring(llama.step, favoured, len(prompt) - 1 + differs_at)
    program = compiler.compile(wrong, llama.example_inputs, "portable", emit_constant_methods=llama.constant_methods)
    check = generation.check_generation(program, llama, "portable", steps)
    assert not check.passed
    assert check.first_difference == differs_at
    assert check.program_tokens[:differs_at] == tuple(eager.tokens[:differs_at])
    assert check.program_tokens[differs_at] == favoured
    assert f"step {differs_at}" in check.describe()
    assert check.worst_logit_error == pytest.approx(100.0, rel=1e-2)


@pytest.mark.slow
def test_the_cli_job_writes_the_program_and_the_tokenizer(tmp_path, capsys):
    assert main(["generate", "gemma", "--backend", "xnnpack", "--tokens", "4", "--max-cache-len", "16",
                 "-o", str(tmp_path), "--check"]) == 0
    assert (tmp_path / "gemma.pte").is_file() and (tmp_path / "tokenizer.json").is_file()
    out = capsys.readouterr().out
    assert "TextLLMRunner" in out and "OK" in out


def test_an_unknown_model_is_a_named_error():
    assert main(["generate", "nonesuch", "--backend", "portable"]) == 2


def test_the_readme_table_is_the_committed_results():
    import json
    import pathlib

    from benchmarks import generation as benchmark  # light: builds no model
    from compiler.tools import readme

    root = pathlib.Path(__file__).resolve().parent.parent
    results = json.loads((root / "benchmarks" / "results" / "generation.json").read_text())["results"]
    text = (root / readme.document(benchmark.SECTION)).read_text()
    assert readme.section(text, benchmark.SECTION) == benchmark.table(results), (
        "regenerate it: python -m benchmarks.generation"
    )


@pytest.mark.parametrize("backend", [pytest.param("coreml", marks=pytest.mark.slow), "mlx"])
def test_reference_executors_keep_the_cache_from_step_to_step(backend):
    job = compiler.generate("llama", backend, tokens=4, check=True, max_cache_len=16)
    assert job.check.runner == generation.REFERENCE
    assert job.check.passed, job.check.describe()
    assert len(job.check.program_tokens) == 4


@pytest.mark.slow
def test_a_save_pretrained_folder_generates_with_its_own_special_ids(tmp_path):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=32, bos_token_id=7, eos_token_id=[8, 9],
    )
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(tmp_path / "tiny-qwen")
    job = compiler.generate(tmp_path / "tiny-qwen", "portable", tokens=4, check=True, max_cache_len=16,
                            output_dir=tmp_path / "out", prompt="t10 t11")
    assert (job.model.bos, job.model.eos) == (7, (8, 9))
    assert "get_eos_ids=8,9" in job.model.constant_methods
    assert job.check.prompt == (7, 10, 11)
    assert job.check.passed, job.check.describe()
    assert (tmp_path / "out" / "tiny-qwen.pte").is_file()


def test_a_prompt_outside_the_vocabulary_or_the_cache_is_a_named_error(llama):
    with pytest.raises(compiler.UserInputError, match="not in the vocabulary: hello"):
        generation.prompt_tokens(llama, "t5 hello")
    with pytest.raises(compiler.UserInputError, match="do not fit the cache"):
        generation.check_generation(b"", llama, "portable", steps=40)


def test_a_quantized_check_is_refused_before_compiling():
    with pytest.raises(compiler.UserInputError, match="quantize"):
        compiler.generate("llama", "xnnpack", check=True, quantize="8da4w")


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["portable", "xnnpack"])
def test_with_dynamic_prefill_the_runner_prefills_the_prompt_in_one_call(backend):
    job = compiler.generate("llama", backend, tokens=4, check=True, max_cache_len=16, dynamic_prefill=True)
    assert "enable_dynamic_shape=true" in job.model.constant_methods
    eager = generation.eager_greedy(job.model, job.check.prompt, 4)
    assert eager.calls[0] == (job.check.prompt, 0) and len(eager.calls) == 4
    assert job.check.runner == generation.RUNNER
    assert job.check.passed, job.check.describe()


def test_a_transformers_config_gets_random_weights(tmp_path):
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        max_position_embeddings=32, bos_token_id=1, eos_token_id=2,
    )
    job = compiler.generate(config, "portable", tokens=3, check=True, max_cache_len=16, prompt="t10",
                            output_dir=tmp_path)
    assert job.model.vocab == 48 and (tmp_path / "llama.pte").is_file()
    assert job.check.passed, job.check.describe()
