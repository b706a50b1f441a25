"""Evaluation and reports: MQAR grid results (`mqar_report`), loss by position and passkey
retrieval beyond the training length (`long_context`), and the lm-evaluation-harness model
"palimpsa" (`harness`; imports lm_eval, so it is not imported here: `pip install -e ".[eval]"`)."""
