"""Tokenizers: SentencePiece (sentencepiece.py), Hugging Face tokenizer.json (hf.py), GGUF vocabularies
(gguf.py), the small JSON files that configure them (files.py), chat templates (chat_template.py), and
``load_tokenizer`` (loader.py), which picks one for a model directory or file."""
