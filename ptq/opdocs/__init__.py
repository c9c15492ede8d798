"""What the op registry documents about itself: the whitepaper sections (`whitepaper`), the operators page
(`operators_doc`) and the conformance harness that measures every op against its float op (`conformance`)."""
