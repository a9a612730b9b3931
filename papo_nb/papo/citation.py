"""What the model card credits (a TRL trainer's ``_paper``): the PAPO paper and its authors."""

import textwrap

# As TRL 0.29.1 credited them (trl/experimental/papo/papo_trainer.py:96-112).
PAPO_AUTHORS = (
    "Zhenhailong Wang",
    "Xuehang Guo",
    "Sofia Stoica",
    "Haiyang Xu",
    "Hongru Wang",
    "Hyeonjeong Ha",
    "Xiusi Chen",
    "Yangyi Chen",
    "Ming Yan",
    "Fei Huang",
    "Heng Ji",
)

PAPO_PAPER = {
    "title": "Perception-Aware Policy Optimization for Multimodal Reasoning",
    "id": "2507.06448",
    # docstyle-ignore
    "citation": textwrap.dedent("""\
        @misc{wang2025perceptionawarepolicyoptimizationmultimodal,
            title        = {{Perception-Aware Policy Optimization for Multimodal Reasoning}},
            author       = {AUTHORS},
            year         = 2025,
            url          = {https://arxiv.org/abs/2507.06448},
            archivePrefix= {arXiv},
            eprint       = {2507.06448},
            primaryClass = {cs.CL}
        }""").replace("AUTHORS", " and ".join(PAPO_AUTHORS)),
}
