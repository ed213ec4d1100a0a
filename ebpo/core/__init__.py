"""Pure torch algorithms, no Ray, no I/O, no global state; imports only `ebpo.model` and `kernels`.

    noise        M2T masking and T2T substitution for CPT/SFT (`make_noisy`, `substitution_ids`)
    objectives   the M2T + T2T mixture loss and Multi-Turn Forward on the noisy+clean layout
    likelihood   the vectorized block-ELBO composite (one forward scores every block), gradient replay
    algos        group advantages, the clipped EBPO surrogate, KL estimators
    fields       `doc`, the documented dataclass field every configuration section uses
"""
