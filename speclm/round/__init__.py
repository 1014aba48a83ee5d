"""The round: propose -> score -> verify -> commit. The one verifier (verify), the running batch
whose round makes those four calls (batch), and the policy that sizes each round's draft from
measured costs (adaptive). The draft's tree type is one floor down, in speclm.tree, which the
proposers and the forward read too."""
