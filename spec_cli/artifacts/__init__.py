"""The contract between stages: artifact formats and their readers/writers. No model code here."""
