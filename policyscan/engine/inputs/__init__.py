"""Inputs: files, directories and globs -> chunks of rows with their conversation cells checked, in bounded memory; the
units of work that workers and Ray read."""
