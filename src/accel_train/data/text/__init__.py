"""Text: token folders (`dataset=tokens`) and their tokenizers, instruction records
(`dataset=sft`), preference pairs (`dataset=preference`), prompts (`dataset=prompts`), the
record formats users bring, and the streaming options of each (token, instruction-row and
preference shards)."""
