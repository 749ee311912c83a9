"""Business Analytics Grader V2: grade Jupyter notebooks on the disaggregated cluster.

    python business_analytics_grader_v2.py examples/notebooks --rubric examples/rubric.yaml --local-cluster

The work is done by ``disaggregated_inference.grading``; this script only parses arguments.
"""
from disaggregated_inference.grading.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
