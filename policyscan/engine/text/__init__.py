"""Text: a conversation cell -> the marked text the encoder reads -> token ids of each policy's prompt."""
