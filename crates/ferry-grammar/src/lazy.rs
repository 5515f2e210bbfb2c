//! [`LazyGrammars`]: a process's grammar engine for one model (the router's, a worker's), built
//! on first use, and the compile pool every request's grammar goes through. The async methods
//! are what servers call: the limits are checked on the caller (cheap scans), the compile runs
//! on the [`CompilePool`].

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use ferry_core::sampling::OutputGrammar;
use ferry_tokenizer::Tokenizer;

use crate::{CompilePool, Constraint, GrammarError, GrammarKind, Grammars, Limits, PoolConfig, limits};

/// Extra time the first compile of a process may take: it builds the model's token trie.
const FIRST_BUILD_SLACK: Duration = Duration::from_secs(60);

/// A [`Grammars`] built on first use (building the token trie takes a moment; a process that
/// never sees a grammar never pays it, nor starts the compile threads), shared by every request
/// of a worker or router. Cloning shares it.
#[derive(Clone)]
pub struct LazyGrammars {
    inner: Arc<Inner>,
}

struct Inner {
    tokenizer: Arc<Tokenizer>,
    vocab: Option<usize>,
    limits: Limits,
    pool_config: PoolConfig,
    cell: OnceLock<Result<Grammars, GrammarError>>,
    pool: OnceLock<Result<CompilePool, GrammarError>>,
}

impl std::fmt::Debug for LazyGrammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LazyGrammars")
            .field("vocab", &self.inner.vocab)
            .field("built", &self.inner.cell.get().is_some())
            .finish()
    }
}

impl LazyGrammars {
    /// See [`Grammars::new`] for `vocab`. Default [`Limits`] and [`PoolConfig`].
    pub fn new(tokenizer: Arc<Tokenizer>, vocab: Option<usize>) -> Self {
        Self::with_config(tokenizer, vocab, Limits::default(), PoolConfig::default())
    }

    pub fn with_config(tokenizer: Arc<Tokenizer>, vocab: Option<usize>, limits: Limits, pool_config: PoolConfig) -> Self {
        let inner = Inner { tokenizer, vocab, limits, pool_config, cell: OnceLock::new(), pool: OnceLock::new() };
        Self { inner: Arc::new(inner) }
    }

    /// The engine, built here on first use (on the calling thread: servers use [`Self::check`]
    /// and [`Self::constraint`], which build it on the pool).
    pub fn get(&self) -> Result<&Grammars, GrammarError> {
        let i = &self.inner;
        i.cell.get_or_init(|| Grammars::with_limits(&i.tokenizer, i.vocab, i.limits.clone())).as_ref().map_err(Clone::clone)
    }

    pub fn limits(&self) -> &Limits {
        &self.inner.limits
    }

    /// Checks `grammar` as a worker would build it ([`Grammars::check`]), on the pool.
    pub async fn check(&self, grammar: &OutputGrammar) -> Result<(), GrammarError> {
        self.constraint(grammar, &[]).await.map(drop)
    }

    /// [`Grammars::constraint`], on the pool.
    pub async fn constraint(&self, grammar: &OutputGrammar, replay: &[u32]) -> Result<Constraint, GrammarError> {
        // The cheap scans first, here: a grammar over the limits never takes a pool place.
        limits::check(grammar, &self.inner.limits)?;
        let pool = self.inner.pool.get_or_init(|| CompilePool::new(self.inner.pool_config.clone())).as_ref().map_err(Clone::clone)?;
        let slack = if self.inner.cell.get().is_some() { Duration::ZERO } else { FIRST_BUILD_SLACK };
        let (me, grammar, replay) = (self.clone(), grammar.clone(), replay.to_vec());
        pool.run(GrammarKind::of(&grammar), slack, move || me.get()?.constraint(&grammar, &replay)).await
    }
}
