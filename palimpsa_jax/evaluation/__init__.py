"""Evaluation and reports: MQAR grid results (`mqar_report`)."""
