"""Records what transformers 4's question-answering pipeline (the one the AWS Hugging Face container runs) answers
for the tiny BERT of ``tests/hf_models.py``, into ``question_answering_transformers_4.json``.

transformers 5 has no such pipeline, so this runs twice: the project's interpreter builds the model, and an
interpreter with transformers 4.57 answers (``pip install "transformers==4.57.6" "tokenizers<0.23" torch``):

    .venv/bin/python tests/resources/record_question_answering.py build /tmp/qa-model
    /path/to/transformers-4-venv/bin/python tests/resources/record_question_answering.py answer /tmp/qa-model
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
TOKENIZER = HERE / "qa-tokenizer"
CONTEXT_TAIL = " paris is the capital of france."
# (question, parameters, words of context): one window, top_k, several windows, the empty answer, all of them.
CASES = [
    ("what is the capital of france", {}, 20),
    ("what is the capital of germany", {"top_k": 3}, 60),
    ("which movie", {"max_seq_len": 48, "doc_stride": 16}, 100),
    ("good or bad", {"handle_impossible_answer": True}, 140),
    ("what story", {"top_k": 2, "max_seq_len": 40, "doc_stride": 10, "max_answer_len": 5}, 180),
]


def main() -> None:
    sys.path.insert(0, str(HERE.parent))
    import hf_models

    step, directory = sys.argv[1], Path(sys.argv[2])
    if step == "build":  # its tokenizer is kept beside the answers: training it again would number words otherwise
        hf_models.bert(directory, "question-answering")
        TOKENIZER.mkdir(exist_ok=True)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(directory / name, TOKENIZER / name)
        return
    import transformers

    pipe = transformers.pipeline("question-answering", model=str(directory), tokenizer=str(directory))
    recorded = []
    for seed, (question, parameters, words) in enumerate(CASES):
        inputs = {"question": question, "context": hf_models.text_of_tokens(words, seed) + CONTEXT_TAIL}
        answer = pipe(question=inputs["question"], context=inputs["context"], **parameters)
        recorded.append({"inputs": inputs, "parameters": parameters, "answer": answer})
    (HERE / "question_answering_transformers_4.json").write_text(json.dumps(recorded, indent=1) + "\n")


if __name__ == "__main__":
    main()
